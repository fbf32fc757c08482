//! Admin requests to the cluster: which brokers exist (GET_BROKER_CLUSTER_INFO, from the name server), how
//! each is configured (GET_BROKER_CONFIG, from the broker), and its ACL 2.0 users and ACLs (AUTH_LIST_*).

use std::collections::BTreeMap;

use rocketmq_protocol::code::request_code::RequestCode;
use rocketmq_protocol::protocol::body::broker_body::cluster_info::ClusterInfo;
use rocketmq_protocol::protocol::header::empty_header::EmptyHeader;
use rocketmq_protocol::protocol::header::get_subscription_group_config_request_header::GetSubscriptionGroupConfigRequestHeader;
use rocketmq_protocol::protocol::remoting_command::RemotingCommand;

use super::client::{BrokerClient, BrokerError};

/// One master broker of the cluster.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct MasterBroker {
    /// `brokerName`.
    pub name: String,
    /// The master's `host:port`.
    pub addr: String,
}

impl BrokerClient {
    /// Every master broker the name server knows, sorted by name.
    ///
    /// # Errors
    /// [`BrokerError`] when no name server answered.
    pub async fn cluster_masters(&self) -> Result<Vec<MasterBroker>, BrokerError> {
        let info = self.cluster_info().await?;
        let mut masters: Vec<MasterBroker> = info
            .broker_addr_table
            .unwrap_or_default()
            .values()
            .filter_map(|data| {
                let addr = data.broker_addrs().get(&0)?;
                Some(MasterBroker { name: data.broker_name().to_string(), addr: addr.to_string() })
            })
            .collect();
        masters.sort();
        Ok(masters)
    }

    /// The names of the clusters the name server knows. (Each is also a topic whose route names every broker
    /// of the cluster.)
    ///
    /// # Errors
    /// [`BrokerError`] when no name server answered.
    pub async fn cluster_names(&self) -> Result<Vec<String>, BrokerError> {
        let info = self.cluster_info().await?;
        Ok(info.cluster_addr_table.unwrap_or_default().keys().map(ToString::to_string).collect())
    }

    /// GET_BROKER_CLUSTER_INFO from the name server.
    async fn cluster_info(&self) -> Result<ClusterInfo, BrokerError> {
        let timeout = self.request_timeout();
        self.pooled()
            .await?
            .handle()
            .broker_cluster_info(timeout.as_millis() as u64)
            .await
            .map_err(|e| BrokerError::from_client(e, timeout))
    }

    /// The broker's running configuration (`key=value` properties, as `mqadmin getBrokerConfig` prints them).
    ///
    /// # Errors
    /// [`BrokerError`] when the broker cannot be asked or refuses.
    pub async fn broker_config(&self, addr: &str) -> Result<BTreeMap<String, String>, BrokerError> {
        let request = RemotingCommand::create_request_command(RequestCode::GetBrokerConfig, EmptyHeader {});
        let body = self.admin_request(addr, request).await?;
        Ok(parse_properties(&String::from_utf8_lossy(&body)))
    }
}

/// `RequestCode.AUTH_LIST_USER` and `AUTH_LIST_ACL` (RocketMQ 5.3+, ACL 2.0).
const AUTH_LIST_USER: i32 = 3005;
const AUTH_LIST_ACL: i32 = 3010;

/// The cluster's ACL 2.0 users and ACLs, as a broker keeps them (JSON lists of `UserInfo` and `AclInfo`; empty
/// when there are none).
#[derive(Debug, Clone, Default)]
pub struct AuthMetadata {
    /// `[{"username":…,"password":…,"userType":"Super"|"Normal","userStatus":"enable"|"disable"},…]`.
    pub users: Vec<u8>,
    /// `[{"subject":"User:…","policies":[{"policyType":…,"entries":[{"resource":…,"actions":[…],…}]}]},…]`.
    pub acls: Vec<u8>,
}

impl BrokerClient {
    /// The users and ACLs of the cluster, from the first master that answers both lists (each broker keeps its
    /// own copy; `mqadmin createUser -c <cluster>` writes every one). Signed with `broker.access_key`: the
    /// broker answers only a user it lets read them.
    ///
    /// # Errors
    /// [`BrokerError`] when no master answered (the last failure).
    pub async fn auth_metadata(&self) -> Result<AuthMetadata, BrokerError> {
        let mut last_error = BrokerError::Unreachable("the name server knows no master broker".to_owned());
        for master in self.cluster_masters().await? {
            match self.auth_metadata_at(&master.addr).await {
                Ok(metadata) => return Ok(metadata),
                Err(error) => last_error = error,
            }
        }
        Err(last_error)
    }

    /// Both lists from the broker at `addr`.
    async fn auth_metadata_at(&self, addr: &str) -> Result<AuthMetadata, BrokerError> {
        let list = |code| self.admin_request(addr, RemotingCommand::create_remoting_command(code));
        Ok(AuthMetadata { users: list(AUTH_LIST_USER).await?, acls: list(AUTH_LIST_ACL).await? })
    }
}

/// `ResponseCode.SUBSCRIPTION_GROUP_NOT_EXIST`: the broker has no config for the group (and creates none).
const SUBSCRIPTION_GROUP_NOT_EXIST: i32 = 26;

impl BrokerClient {
    /// Whether the cluster's config for consumer group `group` makes it orderly (`consumeMessageOrderly`, what
    /// `mqadmin updateSubGroup -o true` sets), as Apache's proxy reads it to decide FIFO. Every master is asked
    /// (each keeps its own copy); one that says so is enough. `None` when no master has the group.
    ///
    /// # Errors
    /// [`BrokerError`] when no master could be asked.
    pub async fn group_consumes_orderly(&self, group: &str) -> Result<Option<bool>, BrokerError> {
        let mut known = None;
        let mut last_error = None;
        for master in self.cluster_masters().await? {
            let header = GetSubscriptionGroupConfigRequestHeader { group: group.into(), rpc_request_header: None };
            let request = RemotingCommand::create_request_command(RequestCode::GetSubscriptionGroupConfig, header);
            match self.admin_request(&master.addr, request).await {
                Ok(body) => {
                    let config: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
                    let orderly = config["consumeMessageOrderly"].as_bool().unwrap_or(false);
                    known = Some(known.unwrap_or(false) || orderly);
                }
                Err(BrokerError::Response { code: SUBSCRIPTION_GROUP_NOT_EXIST, .. }) => {}
                Err(error) => last_error = Some(error),
            }
        }
        match (known, last_error) {
            (None, Some(error)) => Err(error),
            (known, _) => Ok(known),
        }
    }
}

/// Java `Properties` text as the broker writes it: `key=value` lines, `#` comments.
pub fn parse_properties(text: &str) -> BTreeMap<String, String> {
    text.lines()
        .map(str::trim)
        .filter(|line| !line.is_empty() && !line.starts_with('#'))
        .filter_map(|line| line.split_once('='))
        .map(|(k, v)| (k.trim().to_owned(), v.trim().to_owned()))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn properties_text_is_read_as_the_broker_writes_it() {
        let parsed = parse_properties("#comment\nflushDiskType=ASYNC_FLUSH\n brokerRole = SYNC_MASTER \n\nbad line\n");
        assert_eq!(parsed.get("flushDiskType").map(String::as_str), Some("ASYNC_FLUSH"));
        assert_eq!(parsed.get("brokerRole").map(String::as_str), Some("SYNC_MASTER"));
        assert_eq!(parsed.len(), 2);
    }
}
