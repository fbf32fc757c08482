//! The operator CLI's client side: `popgate dlq browse|replay` and `popgate deliveries` call the admin API
//! of a running popgate over HTTP(S), with an admin token, and print its JSON answer.

use std::path::PathBuf;

use serde_json::Value;

/// Where the admin API is and how to authenticate.
#[derive(Debug, Clone, clap::Args)]
pub struct Endpoint {
    /// Base URL of the running popgate.
    #[arg(long, env = "POPGATECTL_URL", default_value = "http://127.0.0.1:8080")]
    pub url: String,
    /// An admin bearer token (read from the environment rather than the command line, so it stays out of
    /// shell history and process lists).
    #[arg(long, env = "POPGATECTL_TOKEN", hide_env_values = true)]
    pub token: Option<String>,
    /// A PEM CA certificate to trust for https (a self-signed popgate certificate).
    #[arg(long)]
    pub ca_cert: Option<PathBuf>,
}

/// Why a CLI call failed.
#[derive(Debug, thiserror::Error)]
pub enum CliError {
    /// The request could not be made.
    #[error("{0}")]
    Request(String),
    /// popgate answered with an error (its JSON error body).
    #[error("HTTP {status}: {body}")]
    Refused {
        /// The HTTP status.
        status: u16,
        /// The error body.
        body: String,
    },
}

/// Calls `method path?query` on the admin API and returns the JSON answer.
///
/// # Errors
/// [`CliError`] when popgate cannot be reached or answers with an error.
pub async fn call(
    endpoint: &Endpoint,
    method: reqwest::Method,
    path: &str,
    query: &[(&str, String)],
) -> Result<Value, CliError> {
    let mut builder = reqwest::Client::builder();
    if let Some(path) = &endpoint.ca_cert {
        let pem = std::fs::read(path).map_err(|e| CliError::Request(format!("{}: {e}", path.display())))?;
        let cert = reqwest::Certificate::from_pem(&pem).map_err(|e| CliError::Request(e.to_string()))?;
        builder = builder.add_root_certificate(cert);
    }
    let client = builder.build().map_err(|e| CliError::Request(e.to_string()))?;
    let url = format!("{}{path}", endpoint.url.trim_end_matches('/'));
    let mut request = client.request(method, url).query(query);
    if let Some(token) = &endpoint.token {
        request = request.bearer_auth(token);
    }
    let response = request.send().await.map_err(|e| CliError::Request(e.to_string()))?;
    let status = response.status();
    let text = response.text().await.map_err(|e| CliError::Request(e.to_string()))?;
    if !status.is_success() {
        return Err(CliError::Refused { status: status.as_u16(), body: text });
    }
    serde_json::from_str(&text).map_err(|e| CliError::Request(format!("answer is not JSON: {e}")))
}
