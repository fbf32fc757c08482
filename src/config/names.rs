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
