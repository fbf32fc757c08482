//! The naming rules of RocketMQ topics and groups, and of the token patterns made of them. They live with
//! the config (the lowest layer) because the config validates names before anything else exists.

/// Longest topic or group name RocketMQ accepts.
pub const MAX_NAME_LEN: usize = 127;

/// A topic or group name: RocketMQ's character set, at most [`MAX_NAME_LEN`] characters.
pub fn is_valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= MAX_NAME_LEN
        && name.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '%' | '|'))
}

/// Whether `pattern` is a valid topic/group name in which `*` may stand for any run of characters.
pub fn is_valid_pattern(pattern: &str) -> bool {
    !pattern.is_empty()
        && pattern.len() <= MAX_NAME_LEN
        && pattern.split('*').all(|piece| piece.is_empty() || is_valid_name(piece))
}

/// The kind of resource an ACL entry names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ResourceType {
    /// `*`: every topic and every group.
    Any,
    /// `Topic:…`.
    Topic,
    /// `Group:…`.
    Group,
}

/// Which names of its type an ACL entry's resource covers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NamePattern {
    /// `Topic:*`, `Group:*`, `*`.
    Any,
    /// Exactly this name.
    Literal(String),
    /// Every name starting with this (`Topic:orders-*`).
    Prefixed(String),
}

/// One ACL 2.0 policy entry, checked: what [`crate::config::AclEntryConfig`] says, typed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AclEntry {
    /// The kind of resource.
    pub resource_type: ResourceType,
    /// The names covered.
    pub names: NamePattern,
    /// Whether the entry speaks of `Pub`.
    pub publish: bool,
    /// Whether the entry speaks of `Sub`.
    pub subscribe: bool,
    /// `Deny` rather than `Allow`.
    pub deny: bool,
    /// The networks it applies to; empty: all.
    pub source_ips: Vec<ipnet::IpNet>,
}

impl AclEntry {
    /// The typed entry, or why `config` is not one. Resource and action names are RocketMQ's, in any case.
    ///
    /// # Errors
    /// A sentence naming the field that is wrong.
    pub fn parse(config: &super::AclEntryConfig) -> Result<AclEntry, String> {
        let (resource_type, names) = parse_resource(config.resource.trim())?;
        let (mut publish, mut subscribe) = (false, false);
        for action in &config.actions {
            match action.trim().to_ascii_lowercase().as_str() {
                "pub" => publish = true,
                "sub" => subscribe = true,
                "all" => (publish, subscribe) = (true, true),
                _ => {
                    return Err(format!(
                        "action `{action}`: popgate's ACLs grant `Pub`, `Sub` and `All` (admin rights are the token's \
                         `admin = true`)"
                    ))
                }
            }
        }
        if !publish && !subscribe {
            return Err("`actions` must name at least one of `Pub`, `Sub`, `All`".to_owned());
        }
        let deny = match config.decision.as_deref().map(|d| d.trim().to_ascii_lowercase()) {
            None => false,
            Some(d) if d == "allow" => false,
            Some(d) if d == "deny" => true,
            Some(other) => return Err(format!("decision `{other}`: must be `Allow` or `Deny`")),
        };
        Ok(AclEntry { resource_type, names, publish, subscribe, deny, source_ips: config.source_ips.clone() })
    }
}

/// `*`, `Topic:<name>`, `Topic:<prefix>*`, `Topic:*`, and the same with `Group:`.
fn parse_resource(text: &str) -> Result<(ResourceType, NamePattern), String> {
    if text == "*" {
        return Ok((ResourceType::Any, NamePattern::Any));
    }
    let bad = || {
        format!("resource `{text}`: write `*`, `Topic:<name>`, `Topic:<prefix>*`, `Topic:*` or the same with `Group:`")
    };
    let (kind, name) = text.split_once(':').ok_or_else(bad)?;
    let resource_type = match kind.to_ascii_lowercase().as_str() {
        "topic" => ResourceType::Topic,
        "group" => ResourceType::Group,
        _ => return Err(bad()),
    };
    let names = match name.strip_suffix('*') {
        Some("") => NamePattern::Any,
        Some(prefix) if is_valid_name(prefix) => NamePattern::Prefixed(prefix.to_owned()),
        None if is_valid_name(name) => NamePattern::Literal(name.to_owned()),
        _ => return Err(bad()),
    };
    Ok((resource_type, names))
}
