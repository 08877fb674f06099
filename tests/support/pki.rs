//! Test certificates made with rcgen: a CA and leaf certificates it signs, for TLS on the gRPC
//! port, towards PostgreSQL, and for client certificates.

use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, IsCa, KeyPair};

/// A certificate and its key, in PEM.
pub struct Pem {
    pub cert: String,
    pub key: String,
}

/// A self-signed CA called `name`.
pub fn new_ca(name: &str) -> CertifiedIssuer<'static, KeyPair> {
    let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params
        .distinguished_name
        .push(rcgen::DnType::CommonName, name);
    CertifiedIssuer::self_signed(params, KeyPair::generate().unwrap()).unwrap()
}

/// A certificate for `names` (DNS names or IP addresses), the first also its common name, signed
/// by `issuer`.
pub fn leaf(issuer: &CertifiedIssuer<'static, KeyPair>, names: &[&str]) -> Pem {
    let key = KeyPair::generate().unwrap();
    let mut params =
        CertificateParams::new(names.iter().map(|n| (*n).to_owned()).collect::<Vec<_>>()).unwrap();
    if let Some(first) = names.first() {
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, *first);
    }
    let cert = params.signed_by(&key, issuer).unwrap();
    Pem {
        cert: cert.pem(),
        key: key.serialize_pem(),
    }
}
