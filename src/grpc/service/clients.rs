//! Which gRPC clients are alive: each client id's kind and when it was last seen, the gauge per kind, a
//! client's goodbye, and the keep-alive loop that keeps live clients' auto-renewed deliveries handed out.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use metrics::gauge;
use tonic::metadata::MetadataMap;

use super::Front;
use crate::auth::Caller;
use crate::gateway::{self, ClientIds, GatewayError};
use crate::grpc::consume::{self, AUTO_RENEW_HOLD, AUTO_RENEW_MAX};
use crate::grpc::proto as pb;
use crate::grpc::status::ok;
use crate::grpc::{deadline, names};
use crate::metrics as m;

/// A client that stops heartbeating (it heartbeats every 10 s) is forgotten after this long.
const CLIENT_EXPIRY: Duration = Duration::from_secs(60);
/// A client seen this recently (any call: heartbeats every 10 s, receives all the time) counts as alive, and
/// the deliveries it holds with `auto_renew` are kept handed out to it.
const ALIVE_WINDOW: Duration = Duration::from_secs(20);
/// How often the deadlines of live clients' auto-renewed deliveries are pushed forward.
const KEEP_ALIVE_EVERY: Duration = Duration::from_secs(5);

/// The client kinds of the `popgate_grpc_clients{kind}` gauge.
const CLIENT_KINDS: [&str; 4] = ["producer", "push_consumer", "simple_consumer", "other"];

/// Which clients were seen when, with a count per kind kept at every change: a call costs a map update and
/// four gauge sets, never a pass over the clients. Whose each client id is, and how many are kept, is the
/// gateway's rule ([`ClientIds`]).
pub(super) struct Liveness {
    seen: ClientIds<Seen>,
    per_kind: [usize; CLIENT_KINDS.len()],
}

/// A client id's kind, when it was last seen, and the request timeout its Settings gave (a long poll keeps
/// half of it back, see `deadline`).
struct Seen {
    kind: &'static str,
    at: Instant,
    request_timeout: Option<Duration>,
}

impl Liveness {
    pub(super) fn new(max_clients: usize, owners: crate::gateway::ClientOwners) -> Liveness {
        Liveness { seen: ClientIds::new(max_clients, "grpc.max_clients", owners), per_kind: [0; CLIENT_KINDS.len()] }
    }

    fn kind_index(kind: &str) -> usize {
        CLIENT_KINDS.iter().position(|k| *k == kind).unwrap_or(CLIENT_KINDS.len() - 1)
    }

    /// `id` was seen now, used by `caller`; its kind is updated when the call tells it.
    ///
    /// # Errors
    /// [`GatewayError::ClientIdTaken`] when another token uses the id, [`GatewayError::TooManyClients`] for a
    /// new id past `grpc.max_clients` (nothing changes).
    fn saw(&mut self, id: &str, kind: Option<&'static str>, now: Instant, caller: &Caller) -> Result<(), GatewayError> {
        let mut new = false;
        let seen = self.seen.claim(id, caller, || {
            new = true;
            Seen { kind: kind.unwrap_or("other"), at: now, request_timeout: None }
        })?;
        if new {
            self.per_kind[Self::kind_index(seen.kind)] += 1;
            return Ok(());
        }
        seen.at = now;
        if let Some(kind) = kind.filter(|k| *k != seen.kind) {
            self.per_kind[Self::kind_index(seen.kind)] -= 1;
            self.per_kind[Self::kind_index(kind)] += 1;
            seen.kind = kind;
        }
        Ok(())
    }

    fn forget(&mut self, id: &str) {
        if let Some(seen) = self.seen.remove(id) {
            self.per_kind[Self::kind_index(seen.kind)] -= 1;
        }
    }

    /// Forgets the clients not seen for [`CLIENT_EXPIRY`].
    fn expire(&mut self, now: Instant) {
        let per_kind = &mut self.per_kind;
        self.seen.retain(|_, seen| {
            let keep = now.duration_since(seen.at) < CLIENT_EXPIRY;
            if !keep {
                per_kind[Self::kind_index(seen.kind)] -= 1;
            }
            keep
        });
    }

    fn publish_gauge(&self) {
        for (kind, count) in CLIENT_KINDS.iter().zip(self.per_kind) {
            gauge!(m::GRPC_CLIENTS, "kind" => *kind).set(count as f64);
        }
    }
}

impl Front {
    /// Notes that the calling client is alive (its kind, when known). Constant time: expiry is the keep-alive
    /// loop's ([`Front::prune_clients`]), not every call's. A new client past `grpc.max_clients` is refused, and
    /// so is a client id another token uses (it is that token's until it expires): a client id names whose
    /// deliveries are kept alive and given back at termination.
    pub(super) fn saw_client(
        &self,
        caller: &Caller,
        metadata: &MetadataMap,
        kind: Option<&'static str>,
    ) -> Result<(), pb::Status> {
        let Some(id) = client_id(metadata) else { return Ok(()) };
        let mut clients = self.clients.lock();
        clients.saw(id, kind, Instant::now(), caller).map_err(|refused| crate::grpc::status::refused(&refused))?;
        clients.publish_gauge();
        Ok(())
    }

    /// A client that terminated is forgotten; a consumer gives back what it holds in its group (and only there,
    /// when it may consume as that group: a client may be in several groups, and anyone may name any client id).
    pub(super) async fn terminate_client(&self, caller: &Caller, id: &str, group: Option<&pb::Resource>) -> pb::Status {
        // A producer names no group (or a blank one).
        let group = group.filter(|g| !g.name.trim().is_empty());
        let group = match group.map(|g| names::group(Some(g))).transpose() {
            Ok(group) => group,
            Err(refused) => return refused,
        };
        let mine = self.clients.lock().seen.of_caller(id, caller).map(|_| ());
        if let Err(taken) = mine {
            return crate::grpc::status::refused(&taken);
        }
        if let Some(group) = group {
            match self.deliveries.leave_group(caller, "grpc", id, &group).await {
                Ok(0) => {}
                Ok(released) => {
                    tracing::info!(client = %id, group, released, "gRPC client terminated; what it held is due again.")
                }
                Err(refused) => return crate::grpc::status::refused(&refused),
            }
        }
        self.forget_client(id);
        ok()
    }

    fn forget_client(&self, id: &str) {
        let mut clients = self.clients.lock();
        clients.forget(id);
        clients.publish_gauge();
    }

    /// Keeps the request timeout a client's Settings give (the SDK's default when they give none).
    pub(super) fn note_request_timeout(&self, metadata: &MetadataMap, settings: &pb::Settings) {
        let Some(id) = client_id(metadata) else { return };
        let timeout = settings.request_timeout.and_then(consume::to_std).unwrap_or(deadline::DEFAULT_REQUEST_TIMEOUT);
        let mut clients = self.clients.lock();
        if let Some(seen) = clients.seen.get_mut(id) {
            seen.request_timeout = Some(timeout);
        }
    }

    /// The request timeout of a client, as its Settings gave it.
    pub(in crate::grpc) fn request_timeout_of(&self, client_id: &str) -> Duration {
        let timeout = self.clients.lock().seen.get(client_id).and_then(|seen| seen.request_timeout);
        timeout.unwrap_or(deadline::DEFAULT_REQUEST_TIMEOUT)
    }

    /// Forgets the clients not seen for [`CLIENT_EXPIRY`]: one pass per keep-alive tick, so a hundred thousand
    /// clients coming and going cost one pass every few seconds, not one per call.
    fn prune_clients(&self) {
        let mut clients = self.clients.lock();
        clients.expire(Instant::now());
        clients.publish_gauge();
    }

    /// The ids of the clients seen within [`ALIVE_WINDOW`].
    fn live_clients(&self) -> HashSet<String> {
        let now = Instant::now();
        let clients = self.clients.lock();
        clients
            .seen
            .iter()
            .filter(|(_, _, seen)| now.duration_since(seen.at) < ALIVE_WINDOW)
            .map(|(id, _, _)| id.to_owned())
            .collect()
    }
}

/// The SDK's version (`x-mq-client-version`), when it sent one.
pub(super) fn client_version(metadata: &MetadataMap) -> Option<&str> {
    metadata.get("x-mq-client-version").and_then(|v| v.to_str().ok())
}

/// The SDK's client id (`x-mq-client-id`), when it sent a usable one.
pub(super) fn client_id(metadata: &MetadataMap) -> Option<&str> {
    metadata.get("x-mq-client-id").and_then(|v| v.to_str().ok()).filter(|id| !id.trim().is_empty())
}

/// Keeps the auto-renewed deliveries of every live client handed out: their deadlines move [`AUTO_RENEW_HOLD`]
/// ahead every [`KEEP_ALIVE_EVERY`]. A client that goes away without a word stops being seen, and what it held
/// comes back through the retry policy once that deadline passes. Ends when the front is dropped.
pub(in crate::grpc) async fn keep_alive_loop(front: std::sync::Weak<Front>) {
    let mut tick = tokio::time::interval(KEEP_ALIVE_EVERY);
    loop {
        tick.tick().await;
        let Some(front) = front.upgrade() else { return };
        front.prune_clients();
        // Holders are named by front (`gateway::holder_id`); records written before that by the bare client id,
        // so both are kept (a bare id names no other front's holder).
        let bare = front.live_clients();
        if bare.is_empty() {
            continue;
        }
        let mut live: std::collections::HashSet<String> =
            bare.iter().map(|id| gateway::holder_id("grpc", id)).collect();
        live.extend(bare);
        if let Err(error) = front.deliveries.keep_held(&live, AUTO_RENEW_HOLD, AUTO_RENEW_MAX).await {
            tracing::warn!(%error, "Could not extend the deliveries live gRPC clients hold; will retry.");
        }
    }
}
