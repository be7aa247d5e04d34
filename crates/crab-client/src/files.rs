//! The file service's calls (`/v1/sandboxes/{name}/files…`, docs/api.md): read and tar out
//! answer the raw bytes, write and tar in send them; the rest answer [`FileEntry`]s.

use http_body_util::BodyExt;
use hyper::Method;

use crab_common::files::{FileEntry, FilesQuery};
use crab_common::ApiError;

use crate::{body_bytes, Client};

fn url(name: &str, route: &str, q: &FilesQuery) -> Result<String, ApiError> {
    let qs = serde_urlencoded::to_string(q)
        .map_err(|e| ApiError::internal(format!("encoding the query: {e}")))?;
    let name: String = name
        .bytes()
        .map(|b| {
            if b.is_ascii_alphanumeric() || b"-_.".contains(&b) {
                (b as char).to_string()
            } else {
                format!("%{b:02X}")
            }
        })
        .collect();
    Ok(format!("/v1/sandboxes/{name}/files{route}?{qs}"))
}

impl Client {
    async fn files_json<T: serde::de::DeserializeOwned>(
        &self,
        method: Method,
        name: &str,
        route: &str,
        q: &FilesQuery,
        body: Option<Vec<u8>>,
    ) -> Result<T, ApiError> {
        let u = url(name, route, q)?;
        let resp = match body {
            Some(b) => self.send_typed(method, &u, "application/octet-stream", b).await?,
            None => self.send(method, &u, None).await?,
        };
        let bytes = body_bytes(resp).await?;
        serde_json::from_slice(&bytes)
            .map_err(|e| ApiError::internal(format!("undecodable answer from the daemon: {e}")))
    }

    async fn files_bytes(
        &self,
        name: &str,
        route: &str,
        q: &FilesQuery,
    ) -> Result<Vec<u8>, ApiError> {
        let resp = self.send(Method::GET, &url(name, route, q)?, None).await?;
        let b = resp.into_body().collect().await.map_err(|e| {
            ApiError::internal(format!(
                "the transfer from sandbox {name} broke off ({e}); the daemon's log says why"
            ))
        })?;
        Ok(b.to_bytes().to_vec())
    }

    /// The bytes of a file in a sandbox.
    pub async fn file_read(&self, name: &str, q: &FilesQuery) -> Result<Vec<u8>, ApiError> {
        self.files_bytes(name, "", q).await
    }

    /// Write a file in a sandbox (parents made); its entry.
    pub async fn file_write(
        &self,
        name: &str,
        q: &FilesQuery,
        data: Vec<u8>,
    ) -> Result<FileEntry, ApiError> {
        self.files_json(Method::PUT, name, "", q, Some(data)).await
    }

    /// Describe a path in a sandbox.
    pub async fn file_stat(&self, name: &str, q: &FilesQuery) -> Result<FileEntry, ApiError> {
        self.files_json(Method::GET, name, "/stat", q, None).await
    }

    /// The entries of a directory in a sandbox (`q.depth` levels).
    pub async fn file_list(&self, name: &str, q: &FilesQuery) -> Result<Vec<FileEntry>, ApiError> {
        self.files_json(Method::GET, name, "/list", q, None).await
    }

    /// Make a directory (and parents) in a sandbox.
    pub async fn file_mkdir(&self, name: &str, q: &FilesQuery) -> Result<FileEntry, ApiError> {
        self.files_json(Method::POST, name, "/mkdir", q, None).await
    }

    /// Remove a file or tree in a sandbox.
    pub async fn file_remove(&self, name: &str, q: &FilesQuery) -> Result<(), ApiError> {
        self.files_json::<serde_json::Value>(Method::DELETE, name, "", q, None).await.map(|_| ())
    }

    /// Rename `q.path` to `q.to` in a sandbox; the new path's entry.
    pub async fn file_rename(&self, name: &str, q: &FilesQuery) -> Result<FileEntry, ApiError> {
        self.files_json(Method::POST, name, "/rename", q, None).await
    }

    /// A tar of a path in a sandbox (`q.contents`: of a directory's contents).
    pub async fn file_tar_out(&self, name: &str, q: &FilesQuery) -> Result<Vec<u8>, ApiError> {
        self.files_bytes(name, "/tar", q).await
    }

    /// Extract a tar under a directory in a sandbox (made when missing).
    pub async fn file_tar_in(
        &self,
        name: &str,
        q: &FilesQuery,
        tar: Vec<u8>,
    ) -> Result<(), ApiError> {
        self.files_json::<serde_json::Value>(Method::PUT, name, "/tar", q, Some(tar))
            .await
            .map(|_| ())
    }
}
