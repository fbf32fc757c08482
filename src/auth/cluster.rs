//! The cluster's own users and ACLs (RocketMQ 5.3+ ACL 2.0, `auth.cluster_acl`): what `mqadmin createUser`
//! and `createAcl` made, read from a broker every `auth.cluster_acl_refresh_secs` (as Apache's proxy refreshes
//! its cache every 20 s), so an app's access key and secret work through popgate unchanged and its ACL
//! decides what it may do.
//!
//! A user's grants are its ACL's entries that speak of `Pub`, `Sub` or `All` on `Topic:` and `Group:`
//! resources (or `*`): the actions popgate's fronts need. Admin actions (`Get`, `List`, `Create`, …) and
//! `Cluster:` / `Namespace:` resources are the cluster's business, and popgate relays no request that needs
//! them. A `Super` user may do everything; a disabled user signs nothing. A read that fails keeps the last
//! users, so a broker restart does not lock every app out.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use serde::Deserialize;

use super::{Caller, Grant, Names, TokenTable};
use crate::broker::admin::AuthMetadata;
use crate::broker::BrokerClient;
use crate::config::names::{AclEntry, ResourceType};
use crate::config::AclEntryConfig;

/// Most users kept from one read (the cluster's operators make them, not clients; the bound is a safeguard).
pub const MAX_USERS: usize = 100_000;

/// The cluster's users, by name: the secret their signatures are keyed by, and what they may do.
#[derive(Debug, Default)]
pub struct ClusterUsers {
    users: HashMap<String, (Vec<u8>, Caller)>,
}

impl ClusterUsers {
    /// How many users.
    pub fn len(&self) -> usize {
        self.users.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.users.is_empty()
    }

    pub(super) fn get(&self, name: &str) -> Option<&(Vec<u8>, Caller)> {
        self.users.get(name)
    }

    /// The users of a broker's answers (`AUTH_LIST_USER`, `AUTH_LIST_ACL`), with their ACLs' grants.
    ///
    /// # Errors
    /// A sentence saying which answer is not the JSON a broker sends.
    pub fn from_metadata(metadata: &AuthMetadata) -> Result<ClusterUsers, String> {
        let users: Vec<UserInfo> = json_list(&metadata.users).map_err(|e| format!("the users: {e}"))?;
        let acls: Vec<AclInfo> = json_list(&metadata.acls).map_err(|e| format!("the ACLs: {e}"))?;
        let mut grants_of: HashMap<&str, Vec<Grant>> = HashMap::new();
        for acl in &acls {
            if let Some(user) = acl.subject.strip_prefix("User:") {
                grants_of.entry(user).or_default().extend(acl.policies.iter().flat_map(PolicyInfo::grants));
            }
        }
        let users = users
            .into_iter()
            .filter(|user| !user.user_status.as_deref().is_some_and(|s| s.eq_ignore_ascii_case("disable")))
            .filter_map(|user| {
                let secret = user.password?.into_bytes();
                let is_super = user.user_type.as_deref().is_some_and(|t| t.eq_ignore_ascii_case("super"));
                // A user without an ACL is known (its requests are refused as unauthorized, not unauthenticated).
                let grants = if is_super {
                    vec![everything()]
                } else {
                    grants_of.remove(user.username.as_str()).unwrap_or_default()
                };
                let caller = Caller {
                    name: user.username.clone(),
                    grants: grants.into(),
                    admin: is_super,
                    unrestricted: false,
                    source_ip: None,
                };
                Some((user.username, (secret, caller)))
            })
            .take(MAX_USERS)
            .collect();
        Ok(ClusterUsers { users })
    }
}

/// Reads the cluster's users and ACLs into `tokens`; a failure is logged and counted, and the last ones stay.
pub async fn read_into(tokens: &TokenTable, broker: &BrokerClient) {
    let read = broker.auth_metadata().await.map_err(|e| e.to_string());
    match read.and_then(|metadata| ClusterUsers::from_metadata(&metadata)) {
        Ok(users) => {
            let count = users.len();
            let changed = tokens.cluster_user_count() != count;
            tokens.set_cluster_users(users);
            metrics::counter!(crate::metrics::CLUSTER_ACL_READS, "result" => "ok").increment(1);
            if changed {
                tracing::info!(users = count, "Read the cluster's users and ACLs.");
            }
        }
        Err(why) => {
            metrics::counter!(crate::metrics::CLUSTER_ACL_READS, "result" => "failed").increment(1);
            tracing::warn!(%why, "Could not read the cluster's users and ACLs; the last ones stay in force.");
        }
    }
}

/// Reads the cluster's users and ACLs every `every`, until the task is dropped.
pub async fn keep_reading(tokens: Arc<TokenTable>, broker: Arc<BrokerClient>, every: Duration) {
    loop {
        tokio::time::sleep(every).await;
        read_into(&tokens, &broker).await;
    }
}

/// A list in a broker's JSON answer; no body at all is an empty list.
fn json_list<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<Vec<T>, serde_json::Error> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Ok(Vec::new());
    }
    serde_json::from_slice(body)
}

/// What a `Super` user may do: everything.
fn everything() -> Grant {
    Grant {
        resource_type: ResourceType::Any,
        names: Names::Any,
        publish: true,
        subscribe: true,
        deny: false,
        source_ips: Vec::new(),
        fallback: false,
    }
}

/// `UserInfo`, as a broker writes it.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct UserInfo {
    username: String,
    password: Option<String>,
    user_type: Option<String>,
    user_status: Option<String>,
}

/// `AclInfo`.
#[derive(Debug, Deserialize)]
struct AclInfo {
    subject: String,
    #[serde(default)]
    policies: Vec<PolicyInfo>,
}

/// `PolicyInfo`: `Custom` (the default) or `Default`.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct PolicyInfo {
    policy_type: Option<String>,
    #[serde(default)]
    entries: Vec<PolicyEntryInfo>,
}

/// `PolicyEntryInfo`.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct PolicyEntryInfo {
    resource: String,
    #[serde(default)]
    actions: Vec<String>,
    #[serde(default)]
    source_ips: Vec<String>,
    decision: Option<String>,
}

impl PolicyInfo {
    /// The entries popgate acts on, as grants; a `Default` policy's decide only where no other grant speaks.
    fn grants(&self) -> Vec<Grant> {
        let fallback = self.policy_type.as_deref().is_some_and(|t| t.eq_ignore_ascii_case("default"));
        self.entries
            .iter()
            .filter_map(PolicyEntryInfo::entry)
            .map(|entry| Grant { fallback, ..Grant::from_entry(entry) })
            .collect()
    }
}

impl PolicyEntryInfo {
    /// The entry, if it speaks of `Pub`, `Sub` or `All` on a topic or group; its other actions dropped.
    fn entry(&self) -> Option<AclEntry> {
        let actions: Vec<String> = self
            .actions
            .iter()
            .filter(|action| ["pub", "sub", "all"].contains(&action.to_ascii_lowercase().as_str()))
            .cloned()
            .collect();
        // A source that is not an address or network is one no request comes from: the entry is dropped
        // rather than widened to every source.
        let source_ips: Option<Vec<ipnet::IpNet>> = self.source_ips.iter().map(|ip| network(ip)).collect();
        let config = AclEntryConfig {
            resource: self.resource.clone(),
            actions,
            decision: self.decision.clone(),
            source_ips: source_ips?,
        };
        AclEntry::parse(&config).ok()
    }
}

/// `10.0.0.0/8` or a single address.
fn network(text: &str) -> Option<ipnet::IpNet> {
    let text = text.trim();
    text.parse().ok().or_else(|| text.parse::<std::net::IpAddr>().ok().map(ipnet::IpNet::from))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::auth::Action;

    /// What `mqadmin listUser` / `listAcl` read from a 5.4.0 broker (fastjson2, keys sorted).
    fn metadata() -> AuthMetadata {
        AuthMetadata {
            users: br#"[{"password":"12345678","userStatus":"enable","userType":"Super","username":"rocketmq"},
                {"password":"alicepw","userStatus":"enable","userType":"Normal","username":"alice"},
                {"password":"bobpw","userStatus":"disable","userType":"Normal","username":"bob"},
                {"password":"carolpw","userStatus":"enable","userType":"Normal","username":"carol"}]"#
                .to_vec(),
            acls: br#"[{"policies":[{"entries":[
                    {"actions":["Pub","Sub"],"decision":"Allow","resource":"Topic:orders","sourceIps":["192.168.0.0/24"]},
                    {"actions":["Sub"],"decision":"Allow","resource":"Group:billing*"},
                    {"actions":["Pub"],"decision":"Deny","resource":"Topic:orders-audit"},
                    {"actions":["Get","List"],"decision":"Allow","resource":"Topic:*"},
                    {"actions":["All"],"decision":"Allow","resource":"Cluster:DefaultCluster"}],
                  "policyType":"Custom"},
                 {"entries":[{"actions":["Pub"],"decision":"Allow","resource":"Topic:orders*"}],"policyType":"Default"}],
                "subject":"User:alice"},
                {"policies":[{"entries":[{"actions":["Pub"],"decision":"Allow","resource":"Topic:x"}]}],"subject":"User:bob"}]"#
                .to_vec(),
        }
    }

    #[test]
    fn a_users_acl_entries_on_topics_and_groups_are_its_grants() {
        let users = ClusterUsers::from_metadata(&metadata()).expect("a broker's answers");
        let (secret, alice) = users.get("alice").expect("alice");
        assert_eq!(secret, b"alicepw");
        let inside = alice.clone().with_address("192.168.0.7".parse().expect("an address"));
        let outside = alice.clone().with_address("10.1.1.1".parse().expect("an address"));
        assert!(inside.may(Action::Publish("orders")));
        assert!(!outside.may(Action::Subscribe("orders")), "the entry is limited to 192.168.0.0/24");
        assert!(alice.may(Action::Consume("billing-eu")));
        assert!(!alice.may(Action::Consume("payments")), "no entry covers it: denied");
        // The Default policy speaks only where no Custom entry covers the request.
        assert!(alice.may(Action::Publish("orders-eu")));
        assert!(!alice.may(Action::Publish("orders-audit")), "a Custom Deny is not overridden by the Default");
        assert!(!alice.may(Action::Subscribe("anything")), "Get and List grant no Sub");
        assert!(!alice.may(Action::Admin));
    }

    #[test]
    fn super_users_may_do_everything_disabled_ones_sign_nothing_and_users_without_an_acl_may_do_nothing() {
        let users = ClusterUsers::from_metadata(&metadata()).expect("a broker's answers");
        let (_, root) = users.get("rocketmq").expect("the super user");
        assert!(root.may(Action::Publish("any")) && root.may(Action::Consume("any")) && root.may(Action::Admin));
        assert!(users.get("bob").is_none(), "bob is disabled");
        let (_, carol) = users.get("carol").expect("carol is known");
        assert!(!carol.may(Action::Publish("orders")) && !carol.may(Action::Consume("billing")), "she has no ACL");
        assert_eq!(users.len(), 3);
    }

    #[test]
    fn no_body_is_no_users_and_a_body_that_is_not_a_brokers_is_refused() {
        let empty = ClusterUsers::from_metadata(&AuthMetadata::default()).expect("empty lists");
        assert!(empty.is_empty());
        let broken = AuthMetadata { users: b"{\"no\":".to_vec(), acls: Vec::new() };
        assert!(ClusterUsers::from_metadata(&broken).expect_err("not JSON").contains("users"));
    }
}
