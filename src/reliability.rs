//! The reliability profile against the brokers actually running: popgate reads each master's
//! `flushDiskType`, `brokerRole` and `inSyncReplicas` (GET_BROKER_CONFIG) at start and every
//! `reliability.broker_check_interval_secs`, and reports every broker weaker than the profile:
//! `popgate_profile_mismatch{broker}` (1 / 0), a WARN log, `/readyz` and `GET /admin/brokers`.
//!
//! What "weaker" means:
//! - a sync-flush profile (`financial`, `durable`) needs `flushDiskType=SYNC_FLUSH`;
//! - a sync-replication profile (`financial`, `balanced`) needs `brokerRole=SYNC_MASTER` **and**
//!   `inSyncReplicas >= 2`: in RocketMQ 5.x a SYNC_MASTER waits for `inSyncReplicas` copies, and the default
//!   of 1 is the master alone, so it answers SEND_OK before any slave has the message.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use metrics::gauge;
use parking_lot::RwLock;
use serde::Serialize;

use crate::broker::BrokerClient;
use crate::clock::Epoch;
use crate::config::Profile;
use crate::metrics as m;

/// What one check found about one master.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct BrokerProfileReport {
    /// `brokerName`.
    pub broker: String,
    /// Master address.
    pub addr: String,
    /// The broker's `flushDiskType`, as read.
    pub flush_disk_type: Option<String>,
    /// The broker's `brokerRole`, as read.
    pub broker_role: Option<String>,
    /// The broker's `inSyncReplicas`, as read.
    pub in_sync_replicas: Option<u32>,
    /// Why the broker is weaker than the profile (empty: it is not).
    pub shortfalls: Vec<String>,
    /// The broker could not be asked.
    pub error: Option<String>,
    /// When it was checked (epoch ms).
    pub checked_at: u64,
}

/// Why a broker with these settings is weaker than `profile` (empty when it is not).
pub fn shortfalls(profile: Profile, settings: &BTreeMap<String, String>) -> Vec<String> {
    let value = |key: &str| settings.get(key).map(String::as_str).unwrap_or("unknown");
    let mut out = Vec::new();
    if profile.sync_flush() && value("flushDiskType") != "SYNC_FLUSH" {
        out.push(format!(
            "flushDiskType is {}; the {} profile needs SYNC_FLUSH",
            value("flushDiskType"),
            profile.name()
        ));
    }
    if profile.sync_replication() {
        let in_sync: u32 = settings.get("inSyncReplicas").and_then(|v| v.parse().ok()).unwrap_or(1);
        if value("brokerRole") != "SYNC_MASTER" {
            out.push(format!(
                "brokerRole is {}; the {} profile needs SYNC_MASTER",
                value("brokerRole"),
                profile.name()
            ));
        } else if in_sync < 2 {
            out.push(format!(
                "inSyncReplicas is {in_sync}: a 5.x SYNC_MASTER then stores before any slave has the message; \
                 the {} profile needs inSyncReplicas >= 2",
                profile.name()
            ));
        }
    }
    out
}

/// The latest report per broker, shared with `/readyz` and the admin API.
pub struct ProfileMonitor {
    profile: Profile,
    broker: Arc<BrokerClient>,
    reports: RwLock<Vec<BrokerProfileReport>>,
}

impl ProfileMonitor {
    /// A monitor that has not checked yet.
    pub fn new(profile: Profile, broker: Arc<BrokerClient>) -> ProfileMonitor {
        ProfileMonitor { profile, broker, reports: RwLock::new(Vec::new()) }
    }

    /// The profile checked against.
    pub fn profile(&self) -> Profile {
        self.profile
    }

    /// Checks every master once, updating the gauge and logging each shortfall.
    ///
    /// # Errors
    /// The name server's failure when the brokers cannot even be listed.
    pub async fn check(&self) -> Result<Vec<BrokerProfileReport>, crate::broker::BrokerError> {
        let masters = self.broker.cluster_masters().await?;
        let mut reports = Vec::with_capacity(masters.len());
        for master in masters {
            let checked_at = u64::try_from(Epoch::now().as_millis()).unwrap_or(0);
            let report = match self.broker.broker_config(&master.addr).await {
                Ok(settings) => BrokerProfileReport {
                    shortfalls: shortfalls(self.profile, &settings),
                    flush_disk_type: settings.get("flushDiskType").cloned(),
                    broker_role: settings.get("brokerRole").cloned(),
                    in_sync_replicas: settings.get("inSyncReplicas").and_then(|v| v.parse().ok()),
                    broker: master.name,
                    addr: master.addr,
                    error: None,
                    checked_at,
                },
                Err(error) => BrokerProfileReport {
                    broker: master.name,
                    addr: master.addr,
                    flush_disk_type: None,
                    broker_role: None,
                    in_sync_replicas: None,
                    shortfalls: Vec::new(),
                    error: Some(error.to_string()),
                    checked_at,
                },
            };
            let mismatch = !report.shortfalls.is_empty();
            gauge!(m::PROFILE_MISMATCH, "broker" => report.broker.clone()).set(if mismatch { 1.0 } else { 0.0 });
            for shortfall in &report.shortfalls {
                tracing::warn!(broker = %report.broker, profile = self.profile.name(), %shortfall, "Broker is weaker than the reliability profile.");
            }
            reports.push(report);
        }
        *self.reports.write() = reports.clone();
        Ok(reports)
    }

    /// The latest reports.
    pub fn reports(&self) -> Vec<BrokerProfileReport> {
        self.reports.read().clone()
    }

    /// Whether any broker was found weaker than the profile at the last check.
    pub fn any_mismatch(&self) -> bool {
        self.reports.read().iter().any(|r| !r.shortfalls.is_empty())
    }

    /// Checks again every `interval` for as long as the task runs.
    pub async fn run(self: Arc<Self>, interval: Duration) {
        let mut tick = tokio::time::interval(interval);
        tick.tick().await;
        loop {
            tick.tick().await;
            if let Err(error) = self.check().await {
                tracing::warn!(%error, "Cannot list the brokers to check the reliability profile.");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(flush: &str, role: &str, in_sync: Option<u32>) -> BTreeMap<String, String> {
        let mut map = BTreeMap::from([
            ("flushDiskType".to_owned(), flush.to_owned()),
            ("brokerRole".to_owned(), role.to_owned()),
        ]);
        if let Some(n) = in_sync {
            map.insert("inSyncReplicas".to_owned(), n.to_string());
        }
        map
    }

    #[test]
    fn a_broker_matching_the_profile_has_no_shortfall() {
        assert!(shortfalls(Profile::Financial, &settings("SYNC_FLUSH", "SYNC_MASTER", Some(2))).is_empty());
        assert!(shortfalls(Profile::Durable, &settings("SYNC_FLUSH", "ASYNC_MASTER", None)).is_empty());
        assert!(shortfalls(Profile::Balanced, &settings("ASYNC_FLUSH", "SYNC_MASTER", Some(2))).is_empty());
        assert!(shortfalls(Profile::Throughput, &settings("ASYNC_FLUSH", "ASYNC_MASTER", None)).is_empty());
    }

    #[test]
    fn async_flush_is_weaker_than_sync_flush_profiles() {
        let found = shortfalls(Profile::Financial, &settings("ASYNC_FLUSH", "SYNC_MASTER", Some(2)));
        assert_eq!(found.len(), 1);
        assert!(found[0].contains("SYNC_FLUSH"), "{found:?}");
        assert_eq!(shortfalls(Profile::Durable, &settings("ASYNC_FLUSH", "ASYNC_MASTER", None)).len(), 1);
    }

    #[test]
    fn async_replication_or_a_single_in_sync_replica_is_weaker_than_sync_replication() {
        assert_eq!(shortfalls(Profile::Balanced, &settings("ASYNC_FLUSH", "ASYNC_MASTER", None)).len(), 1);
        let found = shortfalls(Profile::Balanced, &settings("ASYNC_FLUSH", "SYNC_MASTER", None));
        assert!(found.len() == 1 && found[0].contains("inSyncReplicas is 1"), "{found:?}");
        assert_eq!(shortfalls(Profile::Financial, &settings("ASYNC_FLUSH", "ASYNC_MASTER", None)).len(), 2);
    }
}
