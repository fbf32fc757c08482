//! Which addresses a webhook may connect to: the guard against server-side request forgery (SSRF).
//!
//! A subscriber picks the webhook URL, and popgate connects to it from inside its own network. So every
//! address a webhook connection would use is checked against [`TargetPolicy`]: public unicast addresses
//! pass, the ranges in [`FORBIDDEN_V4`] and [`FORBIDDEN_V6`] do not, unless the operator lists them in
//! `webhook.allowed_networks`. The check is made twice:
//! - at subscribe time, on a literal address in the URL ([`TargetPolicy::check_url`]), so the subscriber
//!   gets a 400 at once;
//! - at every connection, by [`GuardedResolver`], on the addresses a host name resolves to *now*: a public
//!   name may point at 127.0.0.1, or be re-pointed there after subscribe (DNS rebinding), and the pusher
//!   connects only to the addresses that were checked. The pusher checks a literal address again too (a
//!   subscription stored before the guard, or before `allowed_networks` was narrowed).

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::Arc;

use ipnet::{IpNet, Ipv4Net, Ipv6Net};
use reqwest::dns::{Addrs, Name, Resolve, Resolving};
use reqwest::Url;

/// IPv4 ranges a webhook may not reach unless allowed, with the name a refusal gives.
const FORBIDDEN_V4: &[(Ipv4Net, &str)] = &[
    (Ipv4Net::new_assert(Ipv4Addr::new(0, 0, 0, 0), 8), "unspecified (\"this network\")"),
    (Ipv4Net::new_assert(Ipv4Addr::new(10, 0, 0, 0), 8), "private"),
    (Ipv4Net::new_assert(Ipv4Addr::new(100, 64, 0, 0), 10), "shared (carrier-grade NAT)"),
    (Ipv4Net::new_assert(Ipv4Addr::new(127, 0, 0, 0), 8), "loopback"),
    // Includes 169.254.169.254, the cloud metadata service.
    (Ipv4Net::new_assert(Ipv4Addr::new(169, 254, 0, 0), 16), "link-local"),
    (Ipv4Net::new_assert(Ipv4Addr::new(172, 16, 0, 0), 12), "private"),
    (Ipv4Net::new_assert(Ipv4Addr::new(192, 0, 0, 0), 24), "IETF protocol assignment"),
    (Ipv4Net::new_assert(Ipv4Addr::new(192, 168, 0, 0), 16), "private"),
    (Ipv4Net::new_assert(Ipv4Addr::new(198, 18, 0, 0), 15), "benchmarking"),
    (Ipv4Net::new_assert(Ipv4Addr::new(224, 0, 0, 0), 4), "multicast"),
    // Includes 255.255.255.255, the broadcast address.
    (Ipv4Net::new_assert(Ipv4Addr::new(240, 0, 0, 0), 4), "reserved or broadcast"),
];

/// IPv6 ranges a webhook may not reach unless allowed. IPv4-mapped (`::ffff:a.b.c.d`) and NAT64
/// (`64:ff9b::a.b.c.d`) addresses are not listed: they are judged as the IPv4 address they reach.
const FORBIDDEN_V6: &[(Ipv6Net, &str)] = &[
    (Ipv6Net::new_assert(Ipv6Addr::UNSPECIFIED, 128), "unspecified"),
    (Ipv6Net::new_assert(Ipv6Addr::LOCALHOST, 128), "loopback"),
    (Ipv6Net::new_assert(Ipv6Addr::UNSPECIFIED, 96), "IPv4-compatible (deprecated)"),
    (Ipv6Net::new_assert(Ipv6Addr::new(0x64, 0xff9b, 1, 0, 0, 0, 0, 0), 48), "NAT64 local-use"),
    (Ipv6Net::new_assert(Ipv6Addr::new(0xfc00, 0, 0, 0, 0, 0, 0, 0), 7), "unique local (private)"),
    (Ipv6Net::new_assert(Ipv6Addr::new(0xfe80, 0, 0, 0, 0, 0, 0, 0), 10), "link-local"),
    (Ipv6Net::new_assert(Ipv6Addr::new(0xfec0, 0, 0, 0, 0, 0, 0, 0), 10), "site-local (deprecated)"),
    (Ipv6Net::new_assert(Ipv6Addr::new(0xff00, 0, 0, 0, 0, 0, 0, 0), 8), "multicast"),
];

/// The NAT64 well-known prefix: `64:ff9b::a.b.c.d` reaches IPv4 address `a.b.c.d`.
const NAT64: Ipv6Net = Ipv6Net::new_assert(Ipv6Addr::new(0x64, 0xff9b, 0, 0, 0, 0, 0, 0), 96);

/// Where webhooks may connect: every public unicast address, and the operator's `webhook.allowed_networks`.
#[derive(Debug, Clone, Default)]
pub struct TargetPolicy {
    allowed: Vec<IpNet>,
}

/// An address a webhook may not reach, and the range it is in.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ForbiddenAddress {
    /// The address as the connection would use it.
    pub addr: IpAddr,
    /// The refused range it falls in (`loopback`, `private`, ...).
    pub range: &'static str,
}

impl fmt::Display for ForbiddenAddress {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} is a {} address", self.addr, self.range)
    }
}

impl TargetPolicy {
    /// A policy that allows, beyond public addresses, the `allowed` networks.
    pub fn new(allowed: Vec<IpNet>) -> TargetPolicy {
        TargetPolicy { allowed }
    }

    /// `Ok` when a webhook may connect to `addr`.
    ///
    /// # Errors
    /// The refused range `addr` is in, when no allowed network contains it.
    pub fn check(&self, addr: IpAddr) -> Result<(), ForbiddenAddress> {
        let reached = reached_address(addr);
        let Some(range) = forbidden_range(reached) else { return Ok(()) };
        if self.allowed.iter().any(|net| net.contains(&reached) || net.contains(&addr)) {
            return Ok(());
        }
        Err(ForbiddenAddress { addr, range })
    }

    /// Checks the URL's host when it is a literal address (a host name is checked when it is resolved).
    ///
    /// # Errors
    /// As [`TargetPolicy::check`].
    pub fn check_url(&self, url: &Url) -> Result<(), ForbiddenAddress> {
        match literal_address(url) {
            Some(addr) => self.check(addr),
            None => Ok(()),
        }
    }
}

/// The URL's host when it is an address. The URL parser has already turned every spelling of an IPv4
/// address (`2130706433`, `0x7f.1`, `0177.0.0.1`) into dotted decimal, and an IPv6 one is in brackets.
fn literal_address(url: &Url) -> Option<IpAddr> {
    let host = url.host_str()?;
    host.strip_prefix('[').and_then(|h| h.strip_suffix(']')).unwrap_or(host).parse().ok()
}

/// The address a connection to `addr` really reaches: IPv4-mapped and NAT64 addresses reach an IPv4 one.
fn reached_address(addr: IpAddr) -> IpAddr {
    let IpAddr::V6(v6) = addr else { return addr };
    if let Some(v4) = v6.to_ipv4_mapped() {
        return IpAddr::V4(v4);
    }
    if NAT64.contains(&v6) {
        let [.., a, b, c, d] = v6.octets();
        return IpAddr::V4(Ipv4Addr::new(a, b, c, d));
    }
    addr
}

fn forbidden_range(addr: IpAddr) -> Option<&'static str> {
    match addr {
        IpAddr::V4(v4) => FORBIDDEN_V4.iter().find(|(net, _)| net.contains(&v4)).map(|(_, range)| *range),
        IpAddr::V6(v6) => FORBIDDEN_V6.iter().find(|(net, _)| net.contains(&v6)).map(|(_, range)| *range),
    }
}

/// A host name that resolved only to addresses webhooks may not reach. The resolver fails with it, so the
/// request never connects; the pusher finds it in the request error's source chain ([`refused_by`]).
#[derive(Debug)]
pub struct ForbiddenTarget {
    /// The host name.
    pub host: String,
    /// What it resolved to, every one refused.
    pub addresses: Vec<ForbiddenAddress>,
}

impl fmt::Display for ForbiddenTarget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let addresses: Vec<String> = self.addresses.iter().map(ToString::to_string).collect();
        write!(
            f,
            "webhook host `{}` resolves only to addresses outside webhook.allowed_networks: {}",
            self.host,
            addresses.join(", ")
        )
    }
}

impl std::error::Error for ForbiddenTarget {}

/// The [`ForbiddenTarget`] a failed request was refused for, if that is why it failed.
pub fn refused_by<'a>(error: &'a (dyn std::error::Error + 'static)) -> Option<&'a ForbiddenTarget> {
    let mut cause = Some(error);
    while let Some(error) = cause {
        if let Some(refused) = error.downcast_ref::<ForbiddenTarget>() {
            return Some(refused);
        }
        cause = error.source();
    }
    None
}

/// reqwest's DNS resolver for webhook clients: resolves with the system resolver, then keeps only the
/// addresses the policy permits. reqwest connects to nothing else, so the addresses checked are the ones
/// used, at every new connection (no window between a check and the connect for DNS to change in).
#[derive(Debug, Clone)]
pub struct GuardedResolver {
    policy: Arc<TargetPolicy>,
}

impl GuardedResolver {
    /// A resolver that filters by `policy`.
    pub fn new(policy: Arc<TargetPolicy>) -> GuardedResolver {
        GuardedResolver { policy }
    }
}

impl Resolve for GuardedResolver {
    fn resolve(&self, name: Name) -> Resolving {
        let policy = self.policy.clone();
        let host = name.as_str().to_owned();
        Box::pin(async move {
            // Port 0: reqwest puts the URL's port (or the scheme's) on each address.
            let resolved: Vec<SocketAddr> = tokio::net::lookup_host((host.as_str(), 0)).await?.collect();
            let addrs = permitted(&policy, &host, resolved)?;
            Ok(Box::new(addrs.into_iter()) as Addrs)
        })
    }
}

/// The permitted subset of `resolved`; refused addresses are logged.
///
/// # Errors
/// [`ForbiddenTarget`] when no address is permitted.
fn permitted(
    policy: &TargetPolicy,
    host: &str,
    resolved: Vec<SocketAddr>,
) -> Result<Vec<SocketAddr>, Box<dyn std::error::Error + Send + Sync>> {
    if resolved.is_empty() {
        return Err(format!("webhook host `{host}` resolved to no address").into());
    }
    let mut refused = Vec::new();
    let mut kept = Vec::new();
    for addr in resolved {
        match policy.check(addr.ip()) {
            Ok(()) => kept.push(addr),
            Err(forbidden) => refused.push(forbidden),
        }
    }
    if kept.is_empty() {
        return Err(Box::new(ForbiddenTarget { host: host.to_owned(), addresses: refused }));
    }
    if !refused.is_empty() {
        let refused: Vec<String> = refused.iter().map(ToString::to_string).collect();
        let refused = refused.join(", ");
        tracing::warn!(%host, %refused, "Webhook host resolves to refused addresses too; only the others are used.");
    }
    Ok(kept)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(text: &str) -> IpAddr {
        text.parse().expect("test address")
    }

    #[test]
    fn public_addresses_pass_and_every_internal_range_is_refused() {
        let policy = TargetPolicy::default();
        for public in ["93.184.215.14", "8.8.8.8", "1.1.1.1", "2606:4700::1111", "::ffff:8.8.8.8", "64:ff9b::808:808"] {
            assert_eq!(policy.check(ip(public)), Ok(()), "{public}");
        }
        let refused = [
            ("127.0.0.1", "loopback"),
            ("127.255.255.254", "loopback"),
            ("::1", "loopback"),
            ("169.254.169.254", "link-local"),
            ("fe80::1", "link-local"),
            ("10.0.0.1", "private"),
            ("172.16.0.1", "private"),
            ("172.31.255.255", "private"),
            ("192.168.1.1", "private"),
            ("fd00:ec2::254", "unique local (private)"),
            ("fc00::1", "unique local (private)"),
            ("0.0.0.0", "unspecified (\"this network\")"),
            ("::", "unspecified"),
            ("100.64.0.1", "shared (carrier-grade NAT)"),
            ("100.127.255.255", "shared (carrier-grade NAT)"),
            ("224.0.0.1", "multicast"),
            ("ff02::1", "multicast"),
            ("255.255.255.255", "reserved or broadcast"),
            ("::127.0.0.1", "IPv4-compatible (deprecated)"),
            ("64:ff9b:1::1", "NAT64 local-use"),
        ];
        for (addr, range) in refused {
            assert_eq!(policy.check(ip(addr)), Err(ForbiddenAddress { addr: ip(addr), range }), "{addr}");
        }
        // Just outside the ranges.
        for edge in ["172.32.0.1", "100.128.0.1", "169.255.0.1", "11.0.0.1", "192.169.0.1"] {
            assert_eq!(policy.check(ip(edge)), Ok(()), "{edge}");
        }
    }

    #[test]
    fn ipv4_mapped_and_nat64_forms_are_judged_as_the_ipv4_address_they_reach() {
        let policy = TargetPolicy::default();
        for (mapped, range) in [
            ("::ffff:127.0.0.1", "loopback"),
            ("::ffff:169.254.169.254", "link-local"),
            ("::ffff:10.1.2.3", "private"),
            ("::ffff:0.0.0.0", "unspecified (\"this network\")"),
            ("64:ff9b::7f00:1", "loopback"),
            ("64:ff9b::a9fe:a9fe", "link-local"),
        ] {
            assert_eq!(policy.check(ip(mapped)).map_err(|f| f.range), Err(range), "{mapped}");
        }
    }

    #[test]
    fn allowed_networks_open_exactly_their_addresses() {
        let allowed = ["10.1.0.0/16", "127.0.0.1/32", "fd00:1::/64"].map(|n| n.parse().expect("net")).to_vec();
        let policy = TargetPolicy::new(allowed);
        for ok in ["10.1.255.3", "127.0.0.1", "::ffff:127.0.0.1", "fd00:1::9"] {
            assert_eq!(policy.check(ip(ok)), Ok(()), "{ok}");
        }
        for refused in ["10.2.0.1", "127.0.0.2", "::1", "fd00:2::9", "169.254.169.254"] {
            assert!(policy.check(ip(refused)).is_err(), "{refused}");
        }
    }

    #[test]
    fn a_literal_address_in_a_url_is_checked_in_every_spelling_the_url_parser_accepts() {
        let policy = TargetPolicy::default();
        for url in [
            "http://127.0.0.1:8080/hook",
            "http://2130706433/hook",
            "http://0x7f.1/hook",
            "http://0177.0.0.1/hook",
            "http://[::1]/hook",
            "http://[::ffff:7f00:1]/hook",
            "https://169.254.169.254/latest/meta-data",
            "http://0/hook",
        ] {
            let parsed = Url::parse(url).expect("url");
            assert!(policy.check_url(&parsed).is_err(), "{url} is refused");
        }
        for url in ["http://example.com/hook", "http://localhost/hook", "http://8.8.8.8/hook"] {
            assert_eq!(policy.check_url(&Url::parse(url).expect("url")), Ok(()), "{url}: names are checked later");
        }
    }

    #[test]
    fn resolved_addresses_are_filtered_and_a_name_with_none_left_is_refused() {
        let policy = TargetPolicy::default();
        let at = |text: &str| SocketAddr::new(ip(text), 0);
        let kept = permitted(&policy, "mixed.example", vec![at("127.0.0.1"), at("8.8.8.8")]).expect("one is public");
        assert_eq!(kept, vec![at("8.8.8.8")], "only the public address is connected to");
        let error = permitted(&policy, "evil.example", vec![at("127.0.0.1"), at("::1")]).expect_err("all internal");
        let refused = refused_by(error.as_ref()).expect("a ForbiddenTarget");
        assert_eq!(refused.host, "evil.example");
        assert_eq!(refused.addresses.len(), 2);
    }

    #[tokio::test]
    async fn a_client_with_the_guarded_resolver_never_connects_to_a_name_that_resolves_to_loopback() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let port = listener.local_addr().expect("addr").port();
        let client = reqwest::Client::builder()
            .dns_resolver(Arc::new(GuardedResolver::new(Arc::new(TargetPolicy::default()))))
            .timeout(std::time::Duration::from_secs(2))
            .build()
            .expect("client");
        let error = client.get(format!("http://localhost:{port}/")).send().await.expect_err("refused");
        let refused = refused_by(&error).expect("refused by the guard, not a connection error");
        assert_eq!(refused.host, "localhost");
        listener.set_nonblocking(true).expect("nonblocking");
        assert!(listener.accept().is_err(), "nothing connected to the loopback listener");

        // Allowed, it connects: the listener never answers, so the request times out instead.
        let loopback = ["127.0.0.0/8", "::1/128"].map(|n| n.parse().expect("net")).to_vec();
        let client = reqwest::Client::builder()
            .dns_resolver(Arc::new(GuardedResolver::new(Arc::new(TargetPolicy::new(loopback)))))
            .timeout(std::time::Duration::from_millis(500))
            .build()
            .expect("client");
        let error = client.get(format!("http://localhost:{port}/")).send().await.expect_err("no answer");
        assert!(error.is_timeout() && refused_by(&error).is_none(), "allowed: it connected ({error:?})");
    }
}
