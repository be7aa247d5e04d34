//! Proxy configuration: where it listens, where each provider's upstream is, and the limits
//! (body sizes, timeouts) that turn bad input and dead upstreams into clear 4xx/5xx answers.

use std::net::SocketAddr;
use std::time::Duration;

use hyper::Uri;
use serde::{Deserialize, Serialize};

/// Default listen address: loopback only.
pub const DEFAULT_LISTEN: &str = "127.0.0.1:7431";

/// Configuration of the LLM proxy.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ProxyConfig {
    /// Listen address (`--proxy-listen`).
    pub listen: SocketAddr,
    /// Allow a non-loopback listen address. Off by default: the proxy carries API keys.
    pub allow_remote: bool,
    /// OpenAI-style upstream base URL without `/v1` (`--upstream-openai`), e.g.
    /// `http://127.0.0.1:8000` or `https://api.openai.com` (TLS via rustls, system roots).
    pub upstream_openai: String,
    /// Anthropic-style upstream base URL without `/v1` (`--upstream-anthropic`).
    pub upstream_anthropic: String,
    /// Largest accepted request body.
    pub max_request_bytes: usize,
    /// Largest buffered (non-stream) upstream response body.
    pub max_response_bytes: usize,
    /// Time to wait for the upstream's response head.
    pub upstream_timeout: Duration,
    /// Longest silence inside a streamed upstream response.
    pub stream_idle_timeout: Duration,
    /// Longest a response is held for its checkpoint before it is released anyway (and the
    /// checkpoint counted as failed).
    pub gate_timeout: Duration,
    /// Whether conversation-log appends are fsynced (always on in production; benchmarks
    /// measure both).
    pub fsync_log: bool,
    /// Longest a client may take to send a request's head; also how long a kept-alive
    /// connection may sit idle between requests (`--proxy-header-timeout`). `None`: no limit.
    pub header_read_timeout: Option<Duration>,
    /// Longest a client may take to send a request's body, from its head on. `None`: no limit.
    pub body_read_timeout: Option<Duration>,
    /// Concurrent connections to one sandbox's private (in-sandbox) endpoint
    /// (`--proxy-max-connections-per-sandbox`); `0` = no cap.
    pub max_sandbox_connections: usize,
    /// Concurrent connections over all the proxy's listeners; `0` = no cap. The daemon lowers
    /// it to its file-descriptor budget ([`crate::FdBudget`]).
    pub max_connections: usize,
    /// Bytes of turn-request bodies one sandbox may have in memory at once (at least
    /// `max_request_bytes`); `0` = no budget.
    pub max_sandbox_buffered_bytes: usize,
    /// Bytes of turn-request bodies in memory at once over all sandboxes; `0` = no budget.
    pub max_buffered_bytes: usize,
    /// Ask the upstream to stream a chat answer the agent asked for whole (`/chat/completions`,
    /// `/messages`) and hand the agent the answer assembled from the stream
    /// ([`crate::assemble`]): the stream's head is the early signal that wakes a parked
    /// sandbox while the model still generates (`--stream-whole-answers`; the daemon turns
    /// it on when it parks).
    #[serde(default)]
    pub stream_whole_answers: bool,
}

impl ProxyConfig {
    /// The same configuration without any of the connection, time and memory bounds (the
    /// proxy as it was before they existed; the benchmark's baseline arm).
    pub fn unbounded(mut self) -> ProxyConfig {
        self.header_read_timeout = None;
        self.body_read_timeout = None;
        self.max_sandbox_connections = 0;
        self.max_connections = 0;
        self.max_sandbox_buffered_bytes = 0;
        self.max_buffered_bytes = 0;
        self
    }
}

impl Default for ProxyConfig {
    fn default() -> Self {
        ProxyConfig {
            listen: SocketAddr::from(([127, 0, 0, 1], 7431)),
            allow_remote: false,
            upstream_openai: "http://127.0.0.1:8000".into(),
            upstream_anthropic: "http://127.0.0.1:8001".into(),
            max_request_bytes: 32 << 20,
            max_response_bytes: 256 << 20,
            upstream_timeout: Duration::from_secs(600),
            stream_idle_timeout: Duration::from_secs(600),
            gate_timeout: Duration::from_secs(600),
            fsync_log: true,
            header_read_timeout: Some(Duration::from_secs(10)),
            body_read_timeout: Some(Duration::from_secs(60)),
            max_sandbox_connections: 256,
            max_connections: 16384,
            max_sandbox_buffered_bytes: 32 << 20,
            max_buffered_bytes: 96 << 20,
            stream_whole_answers: false,
        }
    }
}

/// A configuration the proxy refuses.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// An upstream URL did not parse or is not `http://host[:port][/prefix]`.
    #[error("upstream {provider} URL {url:?} is invalid: {reason}")]
    BadUpstream {
        /// `openai` or `anthropic`.
        provider: &'static str,
        /// The URL given.
        url: String,
        /// Why.
        reason: String,
    },
    /// An https upstream is configured but no trusted root certificates could be loaded.
    #[error("upstream {provider} is https but no TLS root certificates could be loaded: {reason}; install ca-certificates")]
    NoTlsRoots {
        /// `openai` or `anthropic`.
        provider: &'static str,
        /// Why.
        reason: String,
    },
    /// A non-loopback listen address without `allow_remote`.
    #[error("refusing to listen on {0}: not a loopback address (the proxy carries API keys); pass allow_remote to override")]
    NotLoopback(SocketAddr),
}

/// A parsed upstream base URL.
#[derive(Debug, Clone)]
pub(crate) struct Upstream {
    pub(crate) provider: &'static str,
    pub(crate) url: String,
    pub(crate) scheme: hyper::http::uri::Scheme,
    pub(crate) authority: hyper::http::uri::Authority,
    pub(crate) prefix: String,
}

impl Upstream {
    pub(crate) fn is_https(&self) -> bool {
        self.scheme == hyper::http::uri::Scheme::HTTPS
    }

    pub(crate) fn parse(provider: &'static str, url: &str) -> Result<Upstream, ConfigError> {
        let bad = |reason: &str| ConfigError::BadUpstream {
            provider,
            url: url.to_string(),
            reason: reason.to_string(),
        };
        let uri: Uri =
            url.parse().map_err(|e: hyper::http::uri::InvalidUri| bad(&e.to_string()))?;
        let scheme =
            uri.scheme().cloned().ok_or_else(|| bad("no scheme (use http://host:port)"))?;
        if scheme != hyper::http::uri::Scheme::HTTP && scheme != hyper::http::uri::Scheme::HTTPS {
            return Err(bad("use an http:// or https:// URL"));
        }
        let authority = uri.authority().cloned().ok_or_else(|| bad("no host"))?;
        if uri.query().is_some() {
            return Err(bad("a base URL takes no query"));
        }
        let prefix = uri.path().trim_end_matches('/').to_string();
        Ok(Upstream { provider, url: url.to_string(), scheme, authority, prefix })
    }

    /// The upstream URI for a request path (with query).
    pub(crate) fn uri_for(&self, path_and_query: &str) -> Result<Uri, hyper::http::Error> {
        Uri::builder()
            .scheme(self.scheme.clone())
            .authority(self.authority.clone())
            .path_and_query(format!("{}{}", self.prefix, path_and_query))
            .build()
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn upstreams_parse() {
        let u = Upstream::parse("openai", "http://127.0.0.1:9000/proxy/").unwrap();
        assert_eq!(
            u.uri_for("/v1/chat/completions?x=1").unwrap().to_string(),
            "http://127.0.0.1:9000/proxy/v1/chat/completions?x=1"
        );
        assert!(Upstream::parse("openai", "https://api.openai.com").is_ok());
        assert!(Upstream::parse("openai", "ftp://x").is_err());
        assert!(Upstream::parse("openai", "127.0.0.1:9000").is_err());
        assert!(Upstream::parse("openai", "not a url").is_err());
    }
}
