//! `GET /openapi.json`: the OpenAPI 3 description of the HTTP API, kept in `openapi.json` next to this file
//! and checked against the router's own route table by a test, so it cannot silently drift.

use axum::http::header;
use axum::response::IntoResponse;

/// The document, as served.
pub const DOCUMENT: &str = include_str!("openapi.json");

/// `GET /openapi.json`.
pub async fn document() -> impl IntoResponse {
    ([(header::CONTENT_TYPE, "application/json")], DOCUMENT)
}

#[cfg(test)]
mod tests {
    use super::super::{routes, Route};
    use super::DOCUMENT;

    fn document() -> serde_json::Value {
        serde_json::from_str(DOCUMENT).expect("openapi.json is JSON")
    }

    #[test]
    fn the_document_describes_exactly_the_routes_the_router_serves() {
        let doc = document();
        let paths = doc["paths"].as_object().expect("paths");
        let mut described: Vec<(String, String)> = paths
            .iter()
            .flat_map(|(path, ops)| {
                let ops = ops.as_object().cloned().unwrap_or_default();
                ops.keys().map(|method| (method.to_uppercase(), path.clone())).collect::<Vec<_>>()
            })
            .collect();
        described.sort();
        let served: Vec<(String, String)> =
            routes().iter().map(|Route { method, path }| ((*method).to_owned(), (*path).to_owned())).collect();
        assert_eq!(described, served);
    }

    #[test]
    fn every_error_answer_uses_the_one_error_schema() {
        let doc = document();
        assert_eq!(doc["openapi"].as_str().map(|v| v.starts_with("3.")), Some(true));
        for (path, ops) in doc["paths"].as_object().expect("paths") {
            for (method, op) in ops.as_object().expect("operations") {
                for (status, answer) in op["responses"].as_object().expect("responses") {
                    let is_error = status.starts_with('4') || status.starts_with('5');
                    let schema = &answer["content"]["application/json"]["schema"]["$ref"];
                    // /readyz answers 503 with its own readiness report, not an error.
                    if is_error && path != "/readyz" {
                        assert_eq!(schema, "#/components/schemas/Error", "{method} {path} {status}");
                    }
                }
            }
        }
        let error = &doc["components"]["schemas"]["Error"]["properties"]["error"]["properties"];
        for field in ["code", "message", "field"] {
            assert!(error.get(field).is_some(), "Error schema lacks {field}");
        }
    }

    #[test]
    fn the_nack_delay_maximum_is_the_one_bound_the_dispatcher_enforces() {
        let doc = document();
        let body = &doc["paths"]["/events/nack"]["post"]["requestBody"]["content"]["application/json"]["schema"];
        let delay = &body["properties"]["delayMs"];
        assert_eq!(delay["maximum"].as_u64(), Some(crate::config::bounds::MAX_NACK_DELAY_MS), "{delay}");
        assert_eq!(delay["minimum"].as_u64(), Some(0), "{delay}");
    }
}
