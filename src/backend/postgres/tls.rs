//! TLS for the PostgreSQL driver on rustls, with libpq's `sslmode` meanings: the driver itself only
//! knows whether to ask for TLS, so the verification each mode promises happens here.

use std::future::Future;
use std::io;
use std::path::Path;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::client::WebPkiServerVerifier;
use rustls::crypto::{verify_tls12_signature, verify_tls13_signature, CryptoProvider};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{
    CertificateError, ClientConfig, DigitallySignedStruct, RootCertStore, SignatureScheme,
};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio_postgres::tls::{ChannelBinding, MakeTlsConnect, TlsConnect, TlsStream};

use crate::config::{PostgresTls, SslMode};

/// What `sslmode` asks of the driver: whether to ask the server for TLS at all. Never over Unix
/// sockets, where the server offers none: as libpq does, `sslmode` is ignored there.
pub fn driver_mode(
    tls: &PostgresTls,
    hosts: &[tokio_postgres::config::Host],
) -> tokio_postgres::config::SslMode {
    let sockets_only = !hosts.is_empty()
        && hosts
            .iter()
            .all(|host| matches!(host, tokio_postgres::config::Host::Unix(_)));
    if sockets_only {
        return tokio_postgres::config::SslMode::Disable;
    }
    match tls.mode {
        SslMode::Disable => tokio_postgres::config::SslMode::Disable,
        SslMode::Prefer => tokio_postgres::config::SslMode::Prefer,
        SslMode::Require | SslMode::VerifyCa | SslMode::VerifyFull => {
            tokio_postgres::config::SslMode::Require
        }
    }
}

/// The driver's TLS connector for one `sslmode` and CA file.
#[derive(Clone)]
pub struct Tls(Arc<ClientConfig>);

impl Tls {
    pub fn new(tls: &PostgresTls) -> Result<Tls, String> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let verifier: Arc<dyn ServerCertVerifier> = match tls.mode {
            SslMode::Disable | SslMode::Prefer | SslMode::Require => Arc::new(Lenient {
                provider: provider.clone(),
                chain: None,
            }),
            SslMode::VerifyCa | SslMode::VerifyFull => {
                let roots = Arc::new(trusted_roots(tls.ca_file.as_deref())?);
                let chain = WebPkiServerVerifier::builder_with_provider(roots, provider.clone())
                    .build()
                    .map_err(|e| format!("cannot verify server certificates: {e}"))?;
                if tls.mode == SslMode::VerifyCa {
                    Arc::new(Lenient {
                        provider: provider.clone(),
                        chain: Some(chain),
                    })
                } else {
                    chain
                }
            }
        };
        let config = ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| e.to_string())?
            .dangerous()
            .with_custom_certificate_verifier(verifier)
            .with_no_client_auth();
        Ok(Tls(Arc::new(config)))
    }
}

/// The CA certificates in `ca_file` (`sslrootcert=`), or the system's store.
fn trusted_roots(ca_file: Option<&Path>) -> Result<RootCertStore, String> {
    let mut roots = RootCertStore::empty();
    let certs: Vec<CertificateDer<'static>> = match ca_file {
        Some(path) => crate::input_file::read(path)
            .map_err(|e| e.to_string())
            .and_then(|pem| {
                CertificateDer::pem_slice_iter(&pem)
                    .collect::<Result<_, _>>()
                    .map_err(|e| e.to_string())
            })
            .map_err(|e| format!("sslrootcert={}: {e}", path.display()))?,
        None => rustls_native_certs::load_native_certs().certs,
    };
    let (added, _) = roots.add_parsable_certificates(certs);
    if added == 0 {
        return Err(match ca_file {
            Some(path) => format!("sslrootcert={}: no CA certificate in it", path.display()),
            None => {
                "no CA certificate in the system's store; give one with sslrootcert=".to_owned()
            }
        });
    }
    Ok(roots)
}

/// `require` and `prefer` (no `chain`): encrypted, but any certificate will do, as with libpq.
/// `verify-ca` (a `chain`): the chain must lead to a trusted CA, the name in the certificate is not
/// checked; the chain verifier checks the name only after the chain, so a wrong name means a good
/// chain. Handshake signatures are always verified.
#[derive(Debug)]
struct Lenient {
    provider: Arc<CryptoProvider>,
    chain: Option<Arc<WebPkiServerVerifier>>,
}

impl ServerCertVerifier for Lenient {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        let Some(chain) = &self.chain else {
            return Ok(ServerCertVerified::assertion());
        };
        match chain.verify_server_cert(end_entity, intermediates, server_name, ocsp_response, now) {
            Err(rustls::Error::InvalidCertificate(
                CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. },
            )) => Ok(ServerCertVerified::assertion()),
            other => other,
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls12_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls13_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.provider
            .signature_verification_algorithms
            .supported_schemes()
    }
}

impl<S> MakeTlsConnect<S> for Tls
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    type Stream = Stream<S>;
    type TlsConnect = Connect;
    type Error = io::Error;

    /// Called for every host before the driver knows whether TLS is wanted: a name that cannot be
    /// a certificate's (a Unix socket has none) is an error only if a handshake is attempted.
    fn make_tls_connect(&mut self, domain: &str) -> io::Result<Connect> {
        let name = ServerName::try_from(domain.to_owned()).map_err(|e| match domain {
            "" => "a Unix socket has no host name to verify a certificate against".to_owned(),
            _ => format!("{domain:?} cannot be verified against a certificate: {e}"),
        });
        Ok(Connect {
            config: self.0.clone(),
            name,
        })
    }
}

pub struct Connect {
    config: Arc<ClientConfig>,
    name: Result<ServerName<'static>, String>,
}

type Handshake<S> = Pin<Box<dyn Future<Output = io::Result<Stream<S>>> + Send>>;

impl<S> TlsConnect<S> for Connect
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    type Stream = Stream<S>;
    type Error = io::Error;
    type Future = Handshake<S>;

    fn connect(self, stream: S) -> Handshake<S> {
        let connector = tokio_rustls::TlsConnector::from(self.config);
        Box::pin(async move {
            let name = self
                .name
                .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
            let stream = connector.connect(name, stream).await?;
            Ok(Stream(stream))
        })
    }
}

pub struct Stream<S>(tokio_rustls::client::TlsStream<S>);

impl<S> TlsStream for Stream<S>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    /// SCRAM without channel binding, as libpq's default `channel_binding=prefer` falls back to.
    fn channel_binding(&self) -> ChannelBinding {
        ChannelBinding::none()
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> AsyncRead for Stream<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0).poll_read(cx, buf)
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> AsyncWrite for Stream<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.0).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0).poll_shutdown(cx)
    }
}
