//! The certificates condense trusts on its outgoing TLS connections: the
//! Mozilla roots it is built with, plus the certificates of one PEM file
//! for a private CA. A TLS-inspecting corporate proxy re-signs every
//! upstream's certificate with its own CA, which no public root vouches
//! for: without that CA every request fails with a 502 `UnknownIssuer`.
//!
//! The file is `upstream.ca_file` when it is set, or else the one the
//! `SSL_CERT_FILE` variable names (as OpenSSL, curl and Python read it);
//! either adds to the Mozilla roots, never replaces them. condense's one
//! client takes its roots from here, for every call it makes (forwarded
//! requests, the summarizer's, through an outbound proxy or not).
//!
//! The file is read once, at start-up. One that is missing, unreadable,
//! not PEM, or without a certificate stops condense with an error naming
//! the file and the setting, instead of each request failing later. A
//! certificate in it that cannot be a root is an error in
//! `upstream.ca_file`, which names a CA on purpose; in `SSL_CERT_FILE`,
//! often a whole system bundle, it is skipped with a warning.

use std::ffi::OsStr;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::RootCertStore;
use rustls::pki_types::CertificateDer;
use rustls::pki_types::pem::{self, PemObject};

use crate::config::UpstreamConfig;

/// The largest file read: a system bundle is about 200 KB, and a path that
/// names something endless (`/dev/zero`) must not fill memory.
pub const MAX_FILE_BYTES: u64 = 16 << 20;

/// The configuration key that names the file.
pub const CA_FILE_KEY: &str = "upstream.ca_file";
/// The variable that names it when the key does not.
pub const SSL_CERT_FILE: &str = "SSL_CERT_FILE";

#[derive(Debug, thiserror::Error)]
pub enum TrustError {
    #[error("cannot read {file} (named by {setting}): {source}")]
    Read {
        file: PathBuf,
        setting: &'static str,
        source: std::io::Error,
    },
    #[error(
        "{file} (named by {setting}) is larger than {MAX_FILE_BYTES} bytes: it should be a PEM file of CA certificates"
    )]
    TooLarge {
        file: PathBuf,
        setting: &'static str,
    },
    #[error("{file} (named by {setting}) is not a PEM file of certificates: {reason}")]
    Pem {
        file: PathBuf,
        setting: &'static str,
        reason: String,
    },
    #[error(
        "{file} (named by {setting}) holds no certificate (no -----BEGIN CERTIFICATE----- block)"
    )]
    Empty {
        file: PathBuf,
        setting: &'static str,
    },
    #[error("certificate {index} of {file} (named by {setting}) cannot be a root: {reason}")]
    Unusable {
        file: PathBuf,
        setting: &'static str,
        index: usize,
        reason: String,
    },
    #[error("no certificate of {file} (named by {setting}) can be a root")]
    NoRoot {
        file: PathBuf,
        setting: &'static str,
    },
}

/// The file the extra certificates came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Source {
    pub file: PathBuf,
    /// [`CA_FILE_KEY`] or [`SSL_CERT_FILE`].
    pub setting: &'static str,
}

/// The roots of condense's outgoing TLS connections.
#[derive(Debug, Clone)]
pub struct Trust {
    /// The Mozilla roots and the extra certificates, ready for rustls.
    roots: Arc<RootCertStore>,
    /// The extra certificates alone (what the start-up log reports).
    extra: Arc<[CertificateDer<'static>]>,
    source: Option<Source>,
    /// Certificates of the file that could not be roots, skipped.
    skipped: usize,
}

impl Trust {
    /// The Mozilla roots only.
    pub fn builtin() -> Trust {
        Trust {
            roots: Arc::new(mozilla_roots()),
            extra: Arc::from(Vec::new()),
            source: None,
            skipped: 0,
        }
    }

    /// The roots `config` and this process's `SSL_CERT_FILE` call for.
    pub fn from_config(config: &UpstreamConfig) -> Result<Trust, TrustError> {
        Trust::load(
            config.ca_file.as_deref(),
            std::env::var_os(SSL_CERT_FILE).as_deref(),
        )
    }

    /// The Mozilla roots plus the certificates of `ca_file`, or else of
    /// `ssl_cert_file` (the variable's value; empty counts as unset).
    pub fn load(
        ca_file: Option<&Path>,
        ssl_cert_file: Option<&OsStr>,
    ) -> Result<Trust, TrustError> {
        let source = match (ca_file, ssl_cert_file) {
            (Some(file), _) if !file.as_os_str().is_empty() => Source {
                file: file.to_path_buf(),
                setting: CA_FILE_KEY,
            },
            (_, Some(file)) if !file.is_empty() => Source {
                file: PathBuf::from(file),
                setting: SSL_CERT_FILE,
            },
            _ => return Ok(Trust::builtin()),
        };
        let certs = read_certificates(&source)?;
        let mut roots = mozilla_roots();
        let mut extra = Vec::with_capacity(certs.len());
        let mut skipped = 0;
        for (i, cert) in certs.into_iter().enumerate() {
            match roots.add(cert.clone()) {
                Ok(()) => extra.push(cert),
                Err(e) if source.setting == CA_FILE_KEY => {
                    return Err(TrustError::Unusable {
                        file: source.file,
                        setting: source.setting,
                        index: i + 1,
                        reason: e.to_string(),
                    });
                }
                Err(_) => skipped += 1,
            }
        }
        if extra.is_empty() {
            return Err(TrustError::NoRoot {
                file: source.file,
                setting: source.setting,
            });
        }
        Ok(Trust {
            roots: Arc::new(roots),
            extra: Arc::from(extra),
            source: Some(source),
            skipped,
        })
    }

    /// The file the extra certificates came from, if any.
    pub fn source(&self) -> Option<&Source> {
        self.source.as_ref()
    }

    /// How many certificates the file added.
    pub fn extra_count(&self) -> usize {
        self.extra.len()
    }

    /// How many certificates of the file were skipped (`SSL_CERT_FILE`
    /// only).
    pub fn skipped(&self) -> usize {
        self.skipped
    }

    /// Says at start-up which file condense trusts besides the Mozilla
    /// roots.
    pub fn log(&self) {
        let Some(source) = &self.source else { return };
        tracing::info!(
            file = %source.file.display(),
            setting = source.setting,
            certificates = self.extra.len(),
            "trusting the certificates of this file on outgoing TLS connections, besides the Mozilla roots"
        );
        if self.skipped > 0 {
            tracing::warn!(
                file = %source.file.display(),
                setting = source.setting,
                skipped = self.skipped,
                "some certificates of this file cannot be roots and are not trusted"
            );
        }
    }

    /// A rustls client configuration over these roots, for the
    /// connection pools.
    pub fn client_config(&self) -> Result<rustls::ClientConfig, rustls::Error> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        Ok(rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()?
            .with_root_certificates(self.roots.clone())
            .with_no_client_auth())
    }
}

fn mozilla_roots() -> RootCertStore {
    RootCertStore {
        roots: webpki_roots::TLS_SERVER_ROOTS.to_vec(),
    }
}

/// The certificates of `source`'s file, in order; other PEM blocks (a
/// private key, say) are passed over.
fn read_certificates(source: &Source) -> Result<Vec<CertificateDer<'static>>, TrustError> {
    let (file, setting) = (source.file.clone(), source.setting);
    let read = |source| TrustError::Read {
        file: file.clone(),
        setting,
        source,
    };
    let mut bytes = Vec::new();
    std::fs::File::open(&source.file)
        .and_then(|f| f.take(MAX_FILE_BYTES + 1).read_to_end(&mut bytes))
        .map_err(read)?;
    if bytes.len() as u64 > MAX_FILE_BYTES {
        return Err(TrustError::TooLarge { file, setting });
    }
    let certs = CertificateDer::pem_slice_iter(&bytes)
        .collect::<Result<Vec<_>, pem::Error>>()
        .map_err(|e| TrustError::Pem {
            file: file.clone(),
            setting,
            reason: e.to_string(),
        })?;
    if certs.is_empty() {
        return Err(TrustError::Empty { file, setting });
    }
    Ok(certs)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A PEM block whose contents are not a certificate (three zero bytes).
    const NOT_DER: &[u8] = b"-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n";

    fn fixture(name: &str) -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures/tls")
            .join(name)
    }

    /// A file under the system's temporary directory, removed when
    /// dropped.
    struct Scratch(PathBuf);

    impl Scratch {
        fn new(name: &str, contents: &[u8]) -> Scratch {
            let path = std::env::temp_dir()
                .join(format!("condense-trust-{}-{name}.pem", std::process::id()));
            std::fs::write(&path, contents).unwrap();
            Scratch(path)
        }
    }

    impl Drop for Scratch {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.0);
        }
    }

    #[test]
    fn without_a_file_only_the_mozilla_roots_are_trusted() {
        for (ca, env) in [(None, None), (Some(""), Some("")), (None, Some(""))] {
            let t = Trust::load(ca.map(Path::new), env.map(std::ffi::OsStr::new)).unwrap();
            assert!(t.source().is_none());
            assert_eq!(t.extra_count(), 0);
            assert_eq!(t.roots.len(), webpki_roots::TLS_SERVER_ROOTS.len());
        }
    }

    #[test]
    fn the_ca_file_adds_to_the_mozilla_roots_and_wins_over_ssl_cert_file() {
        let ca = fixture("ca.pem");
        let other = fixture("cert.pem");
        let t = Trust::load(Some(&ca), Some(other.as_os_str())).unwrap();
        assert_eq!(
            t.source(),
            Some(&Source {
                file: ca.clone(),
                setting: CA_FILE_KEY
            })
        );
        assert_eq!(t.extra_count(), 1);
        assert_eq!(t.roots.len(), webpki_roots::TLS_SERVER_ROOTS.len() + 1);
        let t = Trust::load(None, Some(other.as_os_str())).unwrap();
        assert_eq!(t.source().unwrap().setting, SSL_CERT_FILE);
        assert_eq!(t.source().unwrap().file, other);
        // Certificates and a key in one file: the key is passed over.
        let mut both = std::fs::read(fixture("leaf.pem")).unwrap();
        both.extend(std::fs::read(fixture("leaf-key.pem")).unwrap());
        both.extend(std::fs::read(&ca).unwrap());
        let path = Scratch::new("both", &both);
        assert_eq!(Trust::load(Some(&path.0), None).unwrap().extra_count(), 2);
    }

    #[test]
    fn a_file_that_cannot_serve_is_an_error_naming_it_and_its_setting() {
        let missing = Path::new("/nonexistent/condense/corp-ca.pem");
        let garbage = Scratch::new(
            "garbage",
            b"-----BEGIN CERTIFICATE-----\n%%%%\n-----END CERTIFICATE-----\n",
        );
        let unterminated = Scratch::new("unterminated", b"-----BEGIN CERTIFICATE-----\nMIIB\n");
        let key_only = fixture("leaf-key.pem");
        let text = Scratch::new("text", b"not a certificate at all\n");
        let not_der = Scratch::new("not-der", NOT_DER);
        let dir = std::env::temp_dir();
        for (file, setting, says) in [
            (missing, CA_FILE_KEY, "cannot read"),
            (missing, SSL_CERT_FILE, "cannot read"),
            (garbage.0.as_path(), CA_FILE_KEY, "not a PEM file"),
            (unterminated.0.as_path(), CA_FILE_KEY, "not a PEM file"),
            (key_only.as_path(), CA_FILE_KEY, "holds no certificate"),
            (text.0.as_path(), SSL_CERT_FILE, "holds no certificate"),
            (not_der.0.as_path(), CA_FILE_KEY, "cannot be a root"),
            (not_der.0.as_path(), SSL_CERT_FILE, "can be a root"),
            (dir.as_path(), CA_FILE_KEY, "cannot read"),
        ] {
            let err = if setting == CA_FILE_KEY {
                Trust::load(Some(file), None)
            } else {
                Trust::load(None, Some(file.as_os_str()))
            }
            .unwrap_err()
            .to_string();
            let named = format!("{} (named by {setting})", file.display());
            assert!(err.contains(&named) && err.contains(says), "{err}");
        }
    }

    #[test]
    fn an_unusable_certificate_fails_the_ca_file_but_is_skipped_in_ssl_cert_file() {
        let mut bundle = NOT_DER.to_vec();
        bundle.extend(std::fs::read(fixture("ca.pem")).unwrap());
        let path = Scratch::new("bundle", &bundle);
        let err = Trust::load(Some(&path.0), None).unwrap_err().to_string();
        assert!(err.contains("certificate 1 of"), "{err}");
        let t = Trust::load(None, Some(path.0.as_os_str())).unwrap();
        assert_eq!((t.extra_count(), t.skipped()), (1, 1));
    }

    #[test]
    fn an_endless_file_is_read_no_further_than_the_limit() {
        let err = Trust::load(Some(Path::new("/dev/zero")), None)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("/dev/zero") && err.contains("larger than"),
            "{err}"
        );
    }
}
