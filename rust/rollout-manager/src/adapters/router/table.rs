//! The router's view of the registry's routing table: each routable engine with what the hot
//! path derives from its address (the parsed authority, the `Host` header, the engine id as a
//! response header), computed once per published table instead of once per request.

use super::pool::{Pool, Pools};
use crate::foundation::locks::RwLocked;
use crate::registry::fleet::{Backend, Fleet, RoutingTable};
use axum::http::uri::Authority;
use axum::http::HeaderValue;
use std::ops::Deref;
use std::sync::{Arc, RwLock};

/// One routable engine as the router uses it.
#[derive(Debug, Clone)]
pub struct Route {
    backend: Backend,
    /// `backend.authority` parsed once, when it is a plain `host:port` (the router then builds
    /// each request's URI from it without formatting and parsing a string).
    pub uri_authority: Option<Authority>,
    /// The `Host` header of requests to this engine (as HTTP clients derive it from the URL:
    /// `host`, or `host:port` for a port other than 80); None without `uri_authority`.
    pub host_header: Option<HeaderValue>,
    /// The engine id as the `x-rollout-engine-id` response header (None if it is not a valid
    /// header value).
    pub id_header: Option<HeaderValue>,
    /// The engine's weight version as SMG's `x-smg-weight-version` response header (None when
    /// it has none, or it is not a valid header value).
    pub version_header: Option<HeaderValue>,
    /// The router's idle connections to this engine (with `host_header`, a plain `host:port`).
    pub pool: Option<Arc<Pool>>,
}

impl Route {
    fn of(backend: &Backend, pools: &Pools, fleet: &Fleet) -> Self {
        let uri_authority: Option<Authority> = backend.authority.parse().ok();
        let host_header = uri_authority.as_ref().and_then(|a| match a.port_u16() {
            Some(port) if port != 80 => HeaderValue::from_str(&format!("{}:{port}", a.host())).ok(),
            _ => HeaderValue::from_str(a.host()).ok(),
        });
        let pool = host_header.as_ref().map(|_| pools.get(&backend.authority, fleet));
        Self {
            id_header: HeaderValue::from_str(&backend.engine_id).ok(),
            version_header: backend.weight_version.as_deref().and_then(|v| HeaderValue::from_str(v).ok()),
            pool,
            backend: backend.clone(),
            uri_authority,
            host_header,
        }
    }
}

impl Deref for Route {
    type Target = Backend;

    fn deref(&self) -> &Backend {
        &self.backend
    }
}

/// A routing table with its routes.
#[derive(Debug)]
pub struct Routes {
    pub table: Arc<RoutingTable>,
    pub all: Arc<Vec<Route>>,
}

/// The routes of the registry's current table, rebuilt when the registry publishes a new one.
#[derive(Debug)]
pub struct RouteCache(RwLock<Arc<Routes>>);

impl Default for RouteCache {
    fn default() -> Self {
        Self(RwLock::new(Arc::new(Routes { table: Arc::default(), all: Arc::default() })))
    }
}

impl RouteCache {
    /// The routes of `fleet`'s table as it is now (never an older table's).
    pub fn current(&self, fleet: &Fleet, pools: &Pools) -> Arc<Routes> {
        let table = fleet.routes();
        {
            let cached = self.0.read_locked();
            if Arc::ptr_eq(&cached.table, &table) {
                return cached.clone();
            }
        }
        let all = Arc::new(table.backends.iter().map(|b| Route::of(b, pools, fleet)).collect());
        let routes = Arc::new(Routes { table, all });
        *self.0.write_locked() = routes.clone();
        routes
    }
}
