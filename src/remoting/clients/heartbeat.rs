//! What a remoting client's heartbeat says (`HeartbeatData`, as far as popgate reads it): its producer and
//! consumer groups, and each consumer group's subscriptions, as a broker is told them again
//! ([`Registration`]).

use super::*;

/// A client's `HEART_BEAT` body (`HeartbeatData`), as far as popgate reads it.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(in crate::remoting) struct Heartbeat {
    #[serde(rename = "clientID")]
    pub client_id: String,
    #[serde(default)]
    pub producer_data_set: Vec<ProducerData>,
    #[serde(default)]
    pub consumer_data_set: Vec<ConsumerData>,
}

impl Heartbeat {
    /// The heartbeat `request` carries, or the answer refusing it.
    pub fn of(request: &RemotingCommand) -> Result<Heartbeat, crate::remoting::service::Refusal> {
        let refuse = |why: String| crate::remoting::service::Refusal::new(crate::remoting::codes::SYSTEM_ERROR, why);
        let body = request.body().ok_or_else(|| refuse("HEART_BEAT without a body (HeartbeatData)".to_owned()))?;
        if body.len() > MAX_HEARTBEAT_BYTES {
            return Err(refuse(format!("the HEART_BEAT body is over {MAX_HEARTBEAT_BYTES} bytes")));
        }
        serde_json::from_slice(body)
            .map_err(|why| refuse(format!("the HEART_BEAT body (HeartbeatData) does not decode: {why}")))
    }
}

/// A producer group in a heartbeat.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(in crate::remoting) struct ProducerData {
    pub group_name: String,
}

/// A consumer group in a heartbeat.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(in crate::remoting) struct ConsumerData {
    pub group_name: String,
    /// `CONSUME_PASSIVELY` (push consumers) or `CONSUME_ACTIVELY` (pull consumers).
    #[serde(default)]
    pub consume_type: String,
    /// `CLUSTERING` (the members share the queues) or `BROADCASTING` (each member reads every queue).
    #[serde(default)]
    pub message_model: String,
    /// The topics the group reads (and its `%RETRY%` topic).
    #[serde(default)]
    pub subscription_data_set: Vec<SubscriptionData>,
}

/// One subscription of a consumer group in a heartbeat.
#[derive(Debug, Default, Clone, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(in crate::remoting) struct SubscriptionData {
    pub topic: String,
    /// The filter expression (`*`, `TagA || TagB`, an SQL92 condition).
    #[serde(default)]
    pub sub_string: String,
    /// `TAG` or `SQL92`.
    #[serde(default)]
    pub expression_type: String,
    /// When the client last changed the subscription (its clock, ms); its pulls name it, and a broker whose
    /// copy is older refuses them (`SUBSCRIPTION_NOT_LATEST`).
    #[serde(default)]
    pub sub_version: i64,
}

/// A client's heartbeat as popgate passes it on to the brokers: kept with the client, so that a broker which lost
/// the client's consumer groups can be given them again at once. A broker forgets every group registered over
/// a connection when that connection closes, and all of popgate's relayed heartbeats share its connection to
/// the broker; a client straight at the broker would be registered again by its next heartbeat, up to 30 s later.
#[derive(Clone)]
pub(in crate::remoting) struct Registration {
    pub(super) digest: [u8; 32],
    version: i32,
    language: LanguageCode,
    pub(super) body: Bytes,
}

impl Registration {
    /// The registration `request` (a `HEART_BEAT`) carries; `None` without a body.
    pub fn of(request: &RemotingCommand) -> Option<Registration> {
        let body = request.body()?.clone();
        let digest: [u8; 32] = sha2::Sha256::digest(&body).into();
        Some(Registration { digest, version: request.version(), language: request.language(), body })
    }

    /// Whether this registration subscribes consumer group `group` to `topic` at subscription version `version`
    /// or a later one.
    pub fn subscribes_at_least(&self, group: &str, topic: &str, version: i64) -> bool {
        self.subscription(group, topic).is_some_and(|subscription| subscription.sub_version >= version)
    }

    /// Consumer group `group`'s subscription to `topic` in this registration.
    pub fn subscription(&self, group: &str, topic: &str) -> Option<SubscriptionData> {
        let heartbeat = serde_json::from_slice::<Heartbeat>(&self.body).ok()?;
        heartbeat
            .consumer_data_set
            .into_iter()
            .filter(|consumer| consumer.group_name == group)
            .flat_map(|consumer| consumer.subscription_data_set)
            .find(|subscription| subscription.topic == topic)
    }

    /// A `HEART_BEAT` carrying this registration, as the client sent it.
    pub fn command(&self) -> RemotingCommand {
        RemotingCommand::create_remoting_command(codes::HEART_BEAT)
            .set_version(self.version)
            .set_language(self.language)
            .set_body(self.body.clone())
    }
}
