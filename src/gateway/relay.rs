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
