//! Optional TLS on the client-facing ports (docs/security.md): `tls_cert` (a PEM chain, the
//! server's certificate first) and `tls_key` (its PEM private key), read once at start-up.
//! REST gets a rustls acceptor (HTTP/1.1 by ALPN); gRPC gets tonic's TLS with the same files.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use thiserror::Error;
use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio_rustls::rustls::{self, ServerConfig};
use tokio_rustls::TlsAcceptor;

#[derive(Debug, Error)]
pub enum TlsError {
    #[error("tls_cert and tls_key go together: {0} is set but not the other")]
    Half(&'static str),
    #[error("{what} {path}: {problem}")]
    File {
        what: &'static str,
        path: PathBuf,
        problem: String,
    },
    #[error("tls_cert and tls_key do not make a server identity: {0}")]
    Identity(rustls::Error),
}

/// The PEM files of the server's identity.
#[derive(Clone, Debug)]
pub struct TlsFiles {
    pub cert_pem: Vec<u8>,
    pub key_pem: Vec<u8>,
}

impl TlsFiles {
    /// Both files, or neither (no TLS).
    pub fn load(cert: Option<&Path>, key: Option<&Path>) -> Result<Option<TlsFiles>, TlsError> {
        let read = |what, path: &Path| {
            std::fs::read(path).map_err(|e| TlsError::File {
                what,
                path: path.into(),
                problem: e.to_string(),
            })
        };
        match (cert, key) {
            (None, None) => Ok(None),
            (Some(_), None) => Err(TlsError::Half("tls_cert")),
            (None, Some(_)) => Err(TlsError::Half("tls_key")),
            (Some(c), Some(k)) => {
                let files = TlsFiles {
                    cert_pem: read("tls_cert", c)?,
                    key_pem: read("tls_key", k)?,
                };
                files.rest_acceptor(c, k)?; // checked now, not at the first client
                Ok(Some(files))
            }
        }
    }

    /// The REST port's acceptor: HTTP/1.1 only (the front door speaks nothing else).
    pub fn rest_acceptor(&self, cert: &Path, key: &Path) -> Result<TlsAcceptor, TlsError> {
        let bad = |what, path: &Path, problem: String| TlsError::File {
            what,
            path: path.into(),
            problem,
        };
        let chain = CertificateDer::pem_slice_iter(&self.cert_pem)
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| {
                bad(
                    "tls_cert",
                    cert,
                    format!("not a PEM certificate chain: {e}"),
                )
            })?;
        if chain.is_empty() {
            return Err(bad("tls_cert", cert, "holds no PEM certificate".into()));
        }
        let key_der = PrivateKeyDer::from_pem_slice(&self.key_pem)
            .map_err(|e| bad("tls_key", key, format!("not a PEM private key: {e}")))?;
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut config = ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(TlsError::Identity)?
            .with_no_client_auth()
            .with_single_cert(chain, key_der)
            .map_err(TlsError::Identity)?;
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        Ok(TlsAcceptor::from(Arc::new(config)))
    }

    /// tonic's TLS settings for the gRPC port.
    pub fn grpc_config(&self) -> tonic::transport::ServerTlsConfig {
        let identity = tonic::transport::Identity::from_pem(&self.cert_pem, &self.key_pem);
        tonic::transport::ServerTlsConfig::new().identity(identity)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn half_a_pair_or_a_bad_file_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("x.pem");
        std::fs::write(&p, "not pem").unwrap();
        assert!(TlsFiles::load(None, None).unwrap().is_none());
        let e = TlsFiles::load(Some(&p), None).unwrap_err().to_string();
        assert_eq!(
            e,
            "tls_cert and tls_key go together: tls_cert is set but not the other"
        );
        let e = TlsFiles::load(Some(&p), Some(&p)).unwrap_err().to_string();
        assert!(e.contains("holds no PEM certificate"), "{e}");
        let e = TlsFiles::load(Some(&dir.path().join("no")), Some(&p))
            .unwrap_err()
            .to_string();
        assert!(e.starts_with("tls_cert "), "{e}");
    }
}
