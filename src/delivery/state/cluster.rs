//! What the delivery state asks of the RocketMQ cluster: broker ACKs, lease renewals and DLQ writes, behind a
//! small trait so the state machine's unit tests and its model test run against a fake that can fail on
//! command and check what it is asked. In production it is [`BrokerCluster`], the broker client and the
//! publish path; the POP loop and routes stay on the broker client itself.

use std::sync::Arc;

use futures::future::BoxFuture;

use super::super::dlq;
use super::super::record::DeliveryRecord;
use crate::broker::consumer::{AckEntry, ReceiptHandle};
use crate::broker::{BrokerClient, BrokerError};
use crate::publish::{PublishError, Publisher};

/// The cluster operations the delivery state performs.
pub(crate) trait Cluster: Send + Sync {
    /// ACKs one message at its broker (`BrokerClient::ack`).
    fn ack<'a>(&'a self, group: &'a str, handle: &'a ReceiptHandle) -> BoxFuture<'a, Result<(), BrokerError>>;

    /// ACKs many messages, one batch request per broker (`BrokerClient::ack_batch`): per entry, `Ok(true)`
    /// taken, `Ok(false)` ACK it alone, `Err` the broker could not be asked.
    fn ack_batch<'a>(&'a self, entries: &'a [AckEntry<'a>]) -> BoxFuture<'a, Vec<Result<bool, BrokerError>>>;

    /// Extends a lease; the returned handle replaces the old one (`BrokerClient::renew`).
    fn renew<'a>(
        &'a self,
        group: &'a str,
        handle: &'a ReceiptHandle,
        invisible_ms: u64,
    ) -> BoxFuture<'a, Result<ReceiptHandle, BrokerError>>;

    /// Writes the delivery's event (body included) to `%DLQ%<group>` and waits until it is stored.
    fn dead_letter<'a>(&'a self, record: &'a DeliveryRecord) -> BoxFuture<'a, Result<(), PublishError>>;
}

/// The real cluster: the broker client for ACKs and renewals, the publish path for DLQ writes.
pub(crate) struct BrokerCluster {
    pub(crate) broker: Arc<BrokerClient>,
    pub(crate) publisher: Arc<Publisher>,
}

impl Cluster for BrokerCluster {
    fn ack<'a>(&'a self, group: &'a str, handle: &'a ReceiptHandle) -> BoxFuture<'a, Result<(), BrokerError>> {
        Box::pin(self.broker.ack(group, handle))
    }

    fn ack_batch<'a>(&'a self, entries: &'a [AckEntry<'a>]) -> BoxFuture<'a, Vec<Result<bool, BrokerError>>> {
        Box::pin(self.broker.ack_batch(entries))
    }

    fn renew<'a>(
        &'a self,
        group: &'a str,
        handle: &'a ReceiptHandle,
        invisible_ms: u64,
    ) -> BoxFuture<'a, Result<ReceiptHandle, BrokerError>> {
        Box::pin(self.broker.renew(group, handle, invisible_ms))
    }

    fn dead_letter<'a>(&'a self, record: &'a DeliveryRecord) -> BoxFuture<'a, Result<(), PublishError>> {
        Box::pin(dlq::send(&self.publisher, record))
    }
}
