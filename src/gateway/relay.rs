//! Relaying a remoting client's request to its broker or the name server as it is: the requests the remoting
//! front does not serve itself (pulls, offsets, locks, routes, heartbeats). The front checks each request's
//! permission with the gateway first (`remoting::relay::permission`, from its table of relayed codes); this
//! handle then gives it the three calls relaying needs and nothing else of the cluster connection: no send,
//! POP or ACK that would go around the gateway's publishing and settling.

use std::sync::Arc;
use std::time::Duration;

use rocketmq_protocol::protocol::remoting_command::RemotingCommand;

use crate::broker::admin::MasterBroker;
use crate::broker::{BrokerClient, BrokerError};

/// Pauses before asking again a repeatable request the broker could not be reached for: for a couple of
/// milliseconds after a reset the crate still hands out the closed connection (seen: 42 failures in a row,
/// within 2 ms), and a broker that is down is not asked for long.
const REPEAT_PAUSES: [Duration; 2] = [Duration::from_millis(10), Duration::from_millis(100)];

/// The cluster connection, for relaying only.
#[derive(Clone)]
pub struct Relay {
    broker: Arc<BrokerClient>,
}

impl Relay {
    /// Relays over `broker`'s connections.
    pub fn new(broker: Arc<BrokerClient>) -> Relay {
        Relay { broker }
    }

    /// `request` as it is, to the broker at `addr`, signed as popgate; its answer within `timeout`.
    ///
    /// # Errors
    /// [`BrokerError`] when the broker cannot be reached or does not answer in time.
    pub async fn relay(
        &self,
        addr: &str,
        request: &RemotingCommand,
        timeout: Duration,
    ) -> Result<RemotingCommand, BrokerError> {
        self.broker.relay(addr, request, timeout).await
    }

    /// [`Relay::relay`] for a request whose repeat is harmless (a pull, an offset, a lock), asked again (twice
    /// at most, after [`REPEAT_PAUSES`]) when the broker could not be reached. A connection closed under popgate
    /// (a cut, a broker restart) fails the request that meets it before the client crate learns it is closed, and
    /// the next request opens a new one. Straight at the cluster the client's own connection would have been cut
    /// and it would ask again; here its connection to popgate is well, so popgate asks again (seen in CI: the
    /// first pull after a cut was answered "connection failed").
    ///
    /// # Errors
    /// [`BrokerError`] when the last attempt fails too, or one does not answer in time.
    pub async fn relay_repeatable(
        &self,
        addr: &str,
        request: &RemotingCommand,
        timeout: Duration,
    ) -> Result<RemotingCommand, BrokerError> {
        let mut answered = self.broker.relay(addr, request, timeout).await;
        for pause in REPEAT_PAUSES {
            let Err(BrokerError::Unreachable(why)) = &answered else { break };
            tracing::debug!(addr, %why, "A relayed request met a closed connection; asking again.");
            tokio::time::sleep(pause).await;
            answered = self.broker.relay(addr, request, timeout).await;
        }
        answered
    }

    /// `request` as it is, to the first name server that answers.
    ///
    /// # Errors
    /// The last failure when no name server answered.
    pub async fn relay_to_name_server(
        &self,
        request: &RemotingCommand,
        timeout: Duration,
    ) -> Result<RemotingCommand, BrokerError> {
        self.broker.relay_to_name_server(request, timeout).await
    }

    /// Every master broker the name server knows (where a heartbeat goes, and an end a client sent to none).
    ///
    /// # Errors
    /// [`BrokerError`] when no name server answered.
    pub async fn cluster_masters(&self) -> Result<Vec<MasterBroker>, BrokerError> {
        self.broker.cluster_masters().await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::broker::fake_peer::FakePeer;
    use crate::config::BrokerConfig;
    use rocketmq_protocol::code::request_code::RequestCode;

    /// A request sent right after the broker reset its connection: the crate fails it as "connection failed"
    /// (84 of 200 here) when it learnt of the reset only as the request went out. A request whose repeat is
    /// harmless is asked again on a new connection and answered. (A request already in flight when the reset
    /// came is not failed by the crate at all: it waits for its timeout, as a held pull waits at a broker.)
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_repeatable_request_that_meets_a_connection_just_reset_is_asked_again_on_a_new_one() {
        let peer = FakePeer::start().await;
        let config = BrokerConfig { namesrv_addr: "127.0.0.1:1".into(), ..BrokerConfig::default() };
        let relay = Relay::new(Arc::new(BrokerClient::connect(&config, "test").await.expect("client")));
        let pull = RemotingCommand::create_remoting_command(RequestCode::PullMessage.to_i32());
        let timeout = Duration::from_secs(1);
        let mut failed = (0, 0);
        for _ in 0..100 {
            peer.hang_up_once();
            if let Err(BrokerError::Unreachable(_)) = relay.relay(&peer.addr, &pull, timeout).await {
                failed.0 += 1;
            }
            peer.hang_up_once();
            match relay.relay_repeatable(&peer.addr, &pull, timeout).await {
                Err(BrokerError::Unreachable(why)) => panic!("asked again on a new connection, yet: {why}"),
                Err(_) => failed.1 += 1,
                Ok(answer) => assert_eq!(answer.code(), 0),
            }
        }
        println!("relayed once: {} of 100 failed as unreachable; asked again: {} timed out", failed.0, failed.1);
        assert!(failed.1 <= 10, "the few in flight when the reset came time out: {}", failed.1);
    }
}
