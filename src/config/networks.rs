//! How networks are written in the config file: strings, each a CIDR network or a single address. Both
//! `webhook.allowed_networks` and an ACL entry's `source_ips` are read this way, so the one reading has a
//! room of its own rather than living with either section.

use serde::{de::Error, Deserialize, Deserializer, Serializer};

/// Writes each network in CIDR notation.
pub fn serialize<S: Serializer>(networks: &[ipnet::IpNet], serializer: S) -> Result<S::Ok, S::Error> {
    serializer.collect_seq(networks.iter().map(ToString::to_string))
}

/// Reads strings, each a network in CIDR notation or one address.
pub fn deserialize<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Vec<ipnet::IpNet>, D::Error> {
    let written = Vec::<String>::deserialize(deserializer)?;
    written.iter().map(|text| parse(text).map_err(D::Error::custom)).collect()
}

/// A network in CIDR notation, or one address (a /32 or /128).
pub fn parse(text: &str) -> Result<ipnet::IpNet, String> {
    let text = text.trim();
    text.parse::<ipnet::IpNet>()
        .map(|net| net.trunc())
        .or_else(|_| text.parse::<std::net::IpAddr>().map(ipnet::IpNet::from))
        .map_err(|_| format!("`{text}` is not a network: write CIDR notation such as \"10.1.0.0/16\", or one address"))
}
