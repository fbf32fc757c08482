//! Configuration: one TOML file, overridden by `POPGATE_*` environment variables.
//!
//! Every key has a default, so an empty file is a valid configuration for a local broker. Nested keys are
//! reached from the environment with a double underscore: `POPGATE_PUBLISH__SEND_TIMEOUT_MS=5000` sets
//! `publish.send_timeout_ms`. Unknown keys are rejected, and [`Config::load`] validates everything before
//! anything is bound, so popgate never starts half-configured: the error names the key and the reason.
//!
//! A `POPGATE_*` variable that names no config section is not config at all: Kubernetes gives every pod of a
//! namespace with a Service named `popgate` the variables `POPGATE_SERVICE_HOST`, `POPGATE_PORT_8080_TCP`, ….
//! Those are left out and returned in [`LoadedConfig::ignored_env`], for the caller to warn about once its
//! logging is up. A variable that does name a section is config, so a typo in its key stays an error.
//!
//! Field names carry their unit (`_ms`, `_secs`, `_bytes`); the accessors that return [`Duration`](std::time::Duration) convert at
//! the edge.

pub(crate) mod bounds;
pub(crate) mod names;
mod validate;

// Each section's structs live in a file of their concern; they are re-exported here, so every type is still
// `config::XConfig`.
mod auth;
mod broker;
mod delivery;
mod fronts;
mod networks;
mod publish;
mod reliability;
mod tier;
mod transactions;

use std::path::Path;

use figment::providers::{Env, Format, Toml};
use figment::Figment;
use serde::{Deserialize, Serialize};

pub use auth::{AclEntryConfig, AuthConfig, TokenConfig};
pub use broker::BrokerConfig;
pub use delivery::{AdminConfig, DeliveryConfig, WebhookConfig, DEFAULT_GAUGE_REFRESH_MS, MIN_GAUGE_REFRESH_MS};
pub use fronts::{GrpcConfig, RemotingConfig, ServerConfig};
pub use publish::{
    FaultAvoidanceConfig, MessageLimits, PublishConfig, DEFAULT_LATENCY_MAX_MS, DEFAULT_MAX_MESSAGE_BYTES,
    DEFAULT_NETWORK_ERROR_ISOLATION_MS, DEFAULT_NOT_AVAILABLE_MS, DEFAULT_RETRY_TIMES_WHEN_SEND_FAILED,
    DEFAULT_SEND_TIMEOUT_MS, MAX_RETRY_TIMES_WHEN_SEND_FAILED,
};
pub use reliability::{Profile, ReliabilityConfig};
pub use tier::{is_valid_instance_id, TierConfig, MAX_INSTANCE_ID_LEN};
pub use transactions::{CheckerConfig, TransactionConfig};

/// The prefix of every environment variable popgate reads.
pub const ENV_PREFIX: &str = "POPGATE_";

/// The whole configuration of one popgate process.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// The HTTP listener.
    pub server: ServerConfig,
    /// How popgate reaches the RocketMQ cluster.
    pub broker: BrokerConfig,
    /// The publish path: RocketMQ's producer policy.
    pub publish: PublishConfig,
    /// The latency fault-avoidance table (MQFaultStrategy) used to pick brokers.
    pub fault_avoidance: FaultAvoidanceConfig,
    /// The consume path: POP, deferred broker ACK, retries and the dead-letter topic.
    pub delivery: DeliveryConfig,
    /// The reliability profile: what "stored" means, how popgate persists its own state, what it expects of
    /// the brokers.
    pub reliability: ReliabilityConfig,
    /// Who may do what: bearer tokens and their allowed actions.
    pub auth: AuthConfig,
    /// The admin plane (DLQ replay pacing).
    pub admin: AdminConfig,
    /// The RocketMQ 5 gRPC front, for apps built on the official SDKs.
    pub grpc: GrpcConfig,
    /// The RocketMQ remoting front, for apps on the remoting Java client (`rocketmq-client`, 4.x style).
    pub remoting: RemotingConfig,
    /// Which addresses webhook pushes may reach.
    pub webhook: WebhookConfig,
    /// Transactional messages: their producer group and how long their records are kept.
    pub transactions: TransactionConfig,
    /// Several popgate instances as one tier: this instance's id, and the peer link over which any instance
    /// settles a delivery another one handed out.
    pub tier: TierConfig,
}

/// A configuration that cannot be used; the message names the key and the reason.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file or an environment variable could not be read or does not fit the schema.
    #[error("{0}")]
    Parse(String),
    /// Values that parse but cannot work together; one line per problem, each naming its key.
    #[error("invalid configuration:\n{}", .0.join("\n"))]
    Invalid(Vec<String>),
}

/// A validated configuration, and the environment variables that were left out of it.
#[derive(Debug, Clone, PartialEq)]
pub struct LoadedConfig {
    /// The configuration.
    pub config: Config,
    /// The `POPGATE_*` variables that name no config section (Kubernetes' service links), sorted; not config,
    /// so not applied, and worth one warning.
    pub ignored_env: Vec<String>,
}

impl LoadedConfig {
    /// The one warning about [`Self::ignored_env`], or `None` when every variable was config.
    pub fn ignored_env_warning(&self) -> Option<String> {
        (!self.ignored_env.is_empty()).then(|| {
            format!(
                "ignoring {} environment variable(s) that name no config section (not config, e.g. Kubernetes \
                 service links): {}",
                self.ignored_env.len(),
                self.ignored_env.join(", ")
            )
        })
    }
}

impl Config {
    /// Reads `file` (when given) and then the `POPGATE_*` environment, and validates the result.
    ///
    /// # Errors
    /// [`ConfigError`] naming the offending key when the file is missing or malformed, a key is unknown or has
    /// the wrong type, or a value is out of range.
    pub fn load(file: Option<&Path>) -> Result<LoadedConfig, ConfigError> {
        Self::load_from(file, Env::prefixed(ENV_PREFIX).split("__"))
    }

    /// Like [`Config::load`] with an explicit environment provider, so tests never touch the real environment.
    /// `env` is expected to map `POPGATE_A__B` to the key `a.b`, as [`Config::load`]'s does: the ignored
    /// variables are named back that way.
    ///
    /// # Errors
    /// As [`Config::load`].
    pub fn load_from(file: Option<&Path>, env: Env) -> Result<LoadedConfig, ConfigError> {
        let mut figment = Figment::new();
        if let Some(path) = file {
            if !path.is_file() {
                return Err(ConfigError::Parse(format!("config file {} does not exist", path.display())));
            }
            figment = figment.merge(Toml::file(path));
        }
        let sections = section_names();
        let ignored_env = env_outside(&env, &sections);
        let env = env.filter(move |key| names_a_section(key.as_str(), &sections));
        let config: Config = figment.merge(env).extract().map_err(|e| ConfigError::Parse(describe_figment_error(e)))?;
        config.validate()?;
        Ok(LoadedConfig { config, ignored_env })
    }

    /// Parses a TOML string (no environment), validating it: for tests and tools.
    ///
    /// # Errors
    /// As [`Config::load`].
    pub fn from_toml_str(text: &str) -> Result<Config, ConfigError> {
        let config: Config = Figment::new()
            .merge(Toml::string(text))
            .extract()
            .map_err(|e| ConfigError::Parse(describe_figment_error(e)))?;
        config.validate()?;
        Ok(config)
    }

    /// Checks ranges and cross-field rules, reporting every problem at once.
    ///
    /// # Errors
    /// [`ConfigError::Invalid`] listing each bad key.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let problems = validate::problems(self);
        if problems.is_empty() {
            Ok(())
        } else {
            Err(ConfigError::Invalid(problems))
        }
    }
}

/// The top-level sections of the config file (`server`, `broker`, …), read off [`Config`] itself so that a
/// new section is known here without a second list to keep.
fn section_names() -> Vec<String> {
    match serde_json::to_value(Config::default()) {
        Ok(serde_json::Value::Object(sections)) => sections.keys().cloned().collect(),
        _ => Vec::new(),
    }
}

/// Whether an environment key (`publish.send_timeout_ms`, `service_host`) starts with a config section; the
/// provider's keys are not yet lowercased when its filter sees them.
fn names_a_section(key: &str, sections: &[String]) -> bool {
    let first = key.split('.').next().unwrap_or_default();
    sections.iter().any(|section| section.eq_ignore_ascii_case(first))
}

/// The variables of `env` that start with no config section, named as set (`POPGATE_SERVICE_HOST`), sorted.
fn env_outside(env: &Env, sections: &[String]) -> Vec<String> {
    let mut names: Vec<String> = env
        .iter()
        .filter(|(key, _)| !names_a_section(key.as_str(), sections))
        .map(|(key, _)| format!("{ENV_PREFIX}{}", key.as_str().replace('.', "__").to_ascii_uppercase()))
        .collect();
    names.sort();
    names
}

/// Figment's errors name the key path (`publish.send_timeout_ms`); keep every one of them, one per line.
fn describe_figment_error(error: figment::Error) -> String {
    let lines: Vec<String> = error
        .into_iter()
        .map(|e| {
            let key = e.path.join(".");
            if key.is_empty() {
                format!("config: {}", e.kind)
            } else {
                format!("config key `{key}`: {}", e.kind)
            }
        })
        .collect();
    lines.join("\n")
}

#[cfg(test)]
mod tests;
