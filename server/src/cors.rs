//! Cross-origin requests (`--cors-origins`): browser front-ends served from another origin
//! (Open WebUI, a page on localhost:3000) may call the API. tower-http's `CorsLayer` answers
//! preflight `OPTIONS` requests itself (before the API-key check, since browsers send no
//! credentials on a preflight) and adds the `Access-Control-Allow-*` headers to responses.

use axum::http::{HeaderName, HeaderValue, Method, header};
use tower_http::cors::{AllowOrigin, CorsLayer};

use crate::error::ServerError;

/// The origins allowed to call the API from a browser.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CorsOrigins {
    /// `*`: any origin.
    Any,
    /// Exactly these origins (`https://host[:port]`).
    List(Vec<HeaderValue>),
}

impl CorsOrigins {
    /// Parses `*` or a comma-separated list of origins such as
    /// `https://chat.example.com,http://localhost:3000`.
    pub fn parse(text: &str) -> Result<CorsOrigins, ServerError> {
        let bad = |message: String| ServerError::Config {
            setting: "--cors-origins",
            message,
        };
        let items: Vec<&str> = text
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .collect();
        if items.is_empty() {
            return Err(bad("no origin given (`*` allows any)".into()));
        }
        if items.contains(&"*") {
            if items.len() > 1 {
                return Err(bad("`*` allows every origin; give it alone".into()));
            }
            return Ok(CorsOrigins::Any);
        }
        items
            .iter()
            .map(|origin| {
                let well_formed = (origin.starts_with("http://") || origin.starts_with("https://"))
                    && !origin.trim_end_matches('/').contains(['?', '#'])
                    && origin.matches('/').count() == 2;
                if !well_formed {
                    return Err(bad(format!(
                        "`{origin}` is not an origin: expected scheme://host[:port], e.g. \
                         http://localhost:3000"
                    )));
                }
                HeaderValue::from_str(origin)
                    .map_err(|_| bad(format!("`{origin}` is not a valid header value")))
            })
            .collect::<Result<_, _>>()
            .map(CorsOrigins::List)
    }

    /// The layer: the allowed origins may send the API's methods with `Authorization` and
    /// `Content-Type`; preflights are cached for an hour.
    pub(crate) fn layer(&self) -> CorsLayer {
        let origin = match self {
            CorsOrigins::Any => AllowOrigin::any(),
            CorsOrigins::List(list) => AllowOrigin::list(list.iter().cloned()),
        };
        CorsLayer::new()
            .allow_origin(origin)
            .allow_methods([Method::GET, Method::POST, Method::OPTIONS])
            .allow_headers([
                header::AUTHORIZATION,
                header::CONTENT_TYPE,
                HeaderName::from_static("x-requested-with"),
            ])
            .max_age(std::time::Duration::from_secs(3600))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_star_and_lists_and_refuses_the_rest() {
        assert_eq!(CorsOrigins::parse("*").unwrap(), CorsOrigins::Any);
        assert_eq!(
            CorsOrigins::parse(" http://a.test , https://b.test:8443").unwrap(),
            CorsOrigins::List(vec![
                HeaderValue::from_static("http://a.test"),
                HeaderValue::from_static("https://b.test:8443"),
            ])
        );
        for bad in ["", " , ", "*,http://a.test", "a.test", "http://a.test/path"] {
            let err = CorsOrigins::parse(bad).unwrap_err().to_string();
            assert!(err.contains("--cors-origins"), "{bad}: {err}");
        }
    }
}
