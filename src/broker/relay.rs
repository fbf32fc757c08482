//! Passing a remoting client's request on to a broker or a name server unchanged, and its answer back: the
//! remoting front's consumer requests (pulls, offsets, queue locks, send-backs), which the broker that owns
//! the queue must answer itself, as Apache's proxy relays them.
//!
//! Relayed requests travel on client instances of their own (`popgate-relay`, then `popgate-relay-1`, … as
//! relays in flight outgrow one instance: see `client::spread`): a PULL may be held at the broker for up to its
//! suspend time (15 s by the Java client's default), and on the request pool's connections a held request
//! would delay sends and ACKs (see [`super::client`]). The crate runs one call at a time per handle, so each
//! relay checks a handle out for its own time.
//!
//! Every relayed request of many clients shares an instance's one connection per broker, so a relay that
//! times out must not close it: popgate keeps the deadline itself and gives the crate a later one (the crate
//! retires a connection on which a request timed out, failing every other client's held pull on it, and the
//! broker then forgets every group registered over it). A relay given up on is cancelled in the crate; the
//! broker's late answer finds no one waiting and is dropped. Apache's proxy relays asynchronously the same way:
//! a timeout there does not close the channel either.

use std::time::Duration;

use cheetah_string::CheetahString;
use rocketmq_protocol::protocol::remoting_command::RemotingCommand;

use super::client::{BrokerClient, BrokerError};

/// The first client instance relayed requests travel on.
pub(super) const RELAY_INSTANCE: &str = "popgate-relay";
/// How much later than popgate's own deadline the crate's is: far enough that popgate always gives up first.
const CRATE_DEADLINE_SLACK: Duration = Duration::from_secs(30);

impl BrokerClient {
    /// Sends `request` (a client's command: code, header fields, body, version) to `addr` and returns the
    /// answer, waiting at most `timeout`. The request goes out as a new two-way command of popgate's (its own
    /// opaque), whatever the client's flags: a one-way request of the client is answered to nobody.
    ///
    /// # Errors
    /// [`BrokerError`] when the peer cannot be reached or does not answer in time.
    pub async fn relay(
        &self,
        addr: &str,
        request: &RemotingCommand,
        timeout: Duration,
    ) -> Result<RemotingCommand, BrokerError> {
        let lease = self.relay_handle().await?;
        let outgoing = copy_of_request(request);
        let crate_timeout_ms = u64::try_from((timeout + CRATE_DEADLINE_SLACK).as_millis()).unwrap_or(u64::MAX);
        // Dropping the crate's call at popgate's deadline cancels its pending request and leaves the shared
        // connection open (see the module's comment).
        let answered = tokio::time::timeout(
            timeout,
            lease.handle().invoke_remoting(&CheetahString::from(addr), outgoing, crate_timeout_ms),
        )
        .await;
        answered.map_err(|_| BrokerError::Timeout(timeout))?.map_err(|e| BrokerError::from_client(e, timeout))
    }

    /// [`BrokerClient::relay`] to the first configured name server that answers.
    ///
    /// # Errors
    /// The last failure when no name server answered.
    pub async fn relay_to_name_server(
        &self,
        request: &RemotingCommand,
        timeout: Duration,
    ) -> Result<RemotingCommand, BrokerError> {
        let mut last = BrokerError::Client("no name server is configured".to_owned());
        for addr in self.namesrv_addrs() {
            match self.relay(&addr, request, timeout).await {
                Ok(answer) => return Ok(answer),
                Err(error) => last = error,
            }
        }
        Err(last)
    }
}

/// A new request command with `request`'s code, version, language, header fields, remark and body.
fn copy_of_request(request: &RemotingCommand) -> RemotingCommand {
    let mut copy = RemotingCommand::create_remoting_command(request.code())
        .set_version(request.version())
        .set_language(request.language())
        .set_remark_option(request.remark().cloned());
    if let Some(fields) = request.ext_fields() {
        copy = copy.set_ext_fields(fields.clone());
    }
    if let Some(body) = request.body() {
        copy = copy.set_body(body.clone());
    }
    copy
}
