//! A port per broker, for clients before 4.9.5. Those clients do not name the broker in their requests (the
//! `bname` header field): a broker learns it from being the one asked. Apache's proxy refuses them all
//! (`VERSION_NOT_SUPPORTED`). popgate gives such a client a route in which each broker has an address of its own,
//! a port popgate listens on for that broker alone; a request that comes in on it, and names no broker, is for
//! that broker ([`name_the_broker`]). Clients from 4.9.5 on are given popgate's one address for every broker.
//!
//! A broker's port is `remoting.broker_ports.<broker name>` when configured (for firewalls), else a free port
//! chosen when a client first asks for a route naming that broker. Either way it is remembered in the state
//! directory (`remoting-broker-ports.json`) and bound again at start: a client keeps its route for up to 30 s,
//! and a one-way request (a transaction's end) sent to a port popgate no longer listens on would be lost.

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::Arc;

use rocketmq_model::version::RocketMqVersion;
use rocketmq_protocol::protocol::remoting_command::RemotingCommand;
use tokio::net::TcpListener;

use super::codes;
use super::connection::{self, Connection};
use super::service::{field, Front};

/// The first client version that names the broker in its requests.
const NAMES_ITS_BROKER_SINCE: RocketMqVersion = RocketMqVersion::V4_9_5;

/// Whether the client that sent `request` names the broker in its requests.
pub(super) fn names_its_broker(request: &RemotingCommand) -> bool {
    u32::try_from(request.version()).is_ok_and(|v| v >= NAMES_ITS_BROKER_SINCE.ordinal())
}

/// The brokers' own ports, by broker name: the address clients are given for each.
#[derive(Default)]
pub(super) struct BrokerPorts {
    bound: tokio::sync::Mutex<HashMap<String, String>>,
}

/// The file, in the state directory, that remembers each broker's port.
const REMEMBERED: &str = "remoting-broker-ports.json";

impl BrokerPorts {
    /// Binds again every broker port popgate listened on before (and every configured one), so the clients
    /// that kept their route find them after a restart. A port that cannot be bound is logged; it is chosen
    /// anew when a client asks for a route naming its broker.
    pub async fn restore(&self, front: &Arc<Front>) {
        let mut brokers: Vec<String> = remembered(front).into_keys().collect();
        brokers.extend(front.config.remoting.broker_ports.keys().cloned());
        brokers.sort();
        brokers.dedup();
        for broker in brokers {
            if let Err(why) = self.address_of(front, &broker).await {
                tracing::warn!(broker, %why, "A broker's remoting port could not be bound again.");
            }
        }
    }

    /// The address a client before 4.9.5 is given for `broker`: its own port, bound on first use.
    ///
    /// # Errors
    /// When the port cannot be bound.
    pub async fn address_of(&self, front: &Arc<Front>, broker: &str) -> Result<String, String> {
        let mut bound = self.bound.lock().await;
        if let Some(addr) = bound.get(broker) {
            return Ok(addr.clone());
        }
        let listener = bind(front, broker).await?;
        let local = listener.local_addr().map_err(|e| e.to_string())?;
        let advertised = advertised_for(&front.advertised, local);
        tracing::info!(broker, addr = %local, %advertised, "popgate remoting listening for broker {broker} (clients before 4.9.5)");
        let serving: Arc<str> = broker.into();
        tokio::spawn(connection::accept_loop(listener, front.clone(), front.stopped(), Some(serving)));
        bound.insert(broker.to_owned(), advertised.clone());
        remember(front, broker, local.port());
        Ok(advertised)
    }
}

/// Binds `broker`'s port: the configured one, else the one it had before, else (that one taken) a free one.
async fn bind(front: &Front, broker: &str) -> Result<TcpListener, String> {
    let listen = front.config.remoting.listen_addr().ok_or("the remoting front has no listen address")?;
    if let Some(port) = front.config.remoting.broker_ports.get(broker) {
        let addr = SocketAddr::new(listen.ip(), *port);
        return crate::listen::bind(addr)
            .await
            .map_err(|e| format!("could not listen on {addr} for broker {broker}: {e}"));
    }
    if let Some(port) = remembered(front).get(broker) {
        match crate::listen::bind(SocketAddr::new(listen.ip(), *port)).await {
            Ok(listener) => return Ok(listener),
            Err(why) => {
                tracing::warn!(broker, port, %why, "A broker's former remoting port is taken; it gets a new one.")
            }
        }
    }
    let addr = SocketAddr::new(listen.ip(), 0);
    crate::listen::bind(addr).await.map_err(|e| format!("could not listen on {addr} for broker {broker}: {e}"))
}

fn remembered_path(front: &Front) -> std::path::PathBuf {
    front.config.delivery.state_dir.join(REMEMBERED)
}

/// The ports remembered from before (none when the file is missing or unreadable).
fn remembered(front: &Front) -> BTreeMap<String, u16> {
    std::fs::read(remembered_path(front)).ok().and_then(|bytes| serde_json::from_slice(&bytes).ok()).unwrap_or_default()
}

/// Adds `broker`'s port to the remembered ones (written to a temporary file, then renamed: never half written).
fn remember(front: &Front, broker: &str, port: u16) {
    let mut ports = remembered(front);
    if ports.get(broker) == Some(&port) {
        return;
    }
    ports.insert(broker.to_owned(), port);
    let path = remembered_path(front);
    let temporary = path.with_extension("json.tmp");
    let written = serde_json::to_vec(&ports)
        .map_err(std::io::Error::other)
        .and_then(|bytes| std::fs::write(&temporary, bytes))
        .and_then(|()| std::fs::rename(&temporary, &path));
    if let Err(why) = written {
        tracing::warn!(broker, port, %why, "A broker's remoting port could not be remembered; after a restart it may change.");
    }
}

/// The address clients reach a port bound at `local` by: the advertised host, with that port.
fn advertised_for(advertised: &str, local: SocketAddr) -> String {
    match advertised.rsplit_once(':') {
        Some((host, _)) => format!("{host}:{}", local.port()),
        None => local.to_string(),
    }
}

/// A request that came in on a broker's own port, and names no broker, is given that broker's name, as a
/// client from 4.9.5 on would have named it.
pub(super) fn name_the_broker(connection: &Connection, mut request: RemotingCommand) -> RemotingCommand {
    let Some(broker) = connection.broker.as_deref() else { return request };
    // `SEND_MESSAGE_V2` and `SEND_BATCH_MESSAGE` carry their header in one-letter fields; `n` is `bname`.
    let name_field = match request.code() {
        codes::SEND_MESSAGE_V2 | codes::SEND_BATCH_MESSAGE => "n",
        _ => "bname",
    };
    if field(&request, name_field).is_none() {
        request.add_ext_field(name_field, broker);
    }
    request
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_brokers_port_is_advertised_on_the_advertised_host() {
        let local = SocketAddr::from(([0, 0, 0, 0], 40123));
        assert_eq!(advertised_for("popgate.internal:9876", local), "popgate.internal:40123");
        assert_eq!(advertised_for("[::1]:9876", local), "[::1]:40123");
    }

    #[test]
    fn a_request_on_a_brokers_port_is_given_that_brokers_name_unless_it_names_one() {
        let (mut connection, _queue) = Connection::for_test(1);
        connection.broker = Some("broker-b".into());
        let pull = name_the_broker(&connection, RemotingCommand::create_remoting_command(codes::PULL_MESSAGE));
        assert_eq!(field(&pull, "bname"), Some("broker-b"));
        let send = name_the_broker(&connection, RemotingCommand::create_remoting_command(codes::SEND_MESSAGE_V2));
        assert_eq!(field(&send, "n"), Some("broker-b"));
        let mut named = RemotingCommand::create_remoting_command(codes::PULL_MESSAGE);
        named.add_ext_field("bname", "broker-a");
        assert_eq!(field(&name_the_broker(&connection, named), "bname"), Some("broker-a"));
    }
}
