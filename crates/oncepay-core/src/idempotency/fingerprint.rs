//! The request fingerprint: SHA-256 over the method, the route and the
//! canonical form of the parsed parameters.

use sha2::{Digest, Sha256};

/// Two requests with equal fingerprints ask for the same operation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Fingerprint(pub [u8; 32]);

impl Fingerprint {
    /// `canonical` must already be independent of encoding and key order
    /// (see `NewCharge::canonical`). The parts are length-prefixed so that no
    /// two different triples hash the same bytes.
    pub fn of(method: &str, route: &str, canonical: &[u8]) -> Self {
        let mut hasher = Sha256::new();
        for part in [method.as_bytes(), route.as_bytes(), canonical] {
            hasher.update((part.len() as u64).to_be_bytes());
            hasher.update(part);
        }
        Fingerprint(hasher.finalize().into())
    }

    /// A stored fingerprint; `None` unless it is 32 bytes.
    pub fn from_slice(bytes: &[u8]) -> Option<Self> {
        bytes.try_into().ok().map(Fingerprint)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn method_route_and_parameters_all_count() {
        let base = Fingerprint::of("POST", "/v1/charges", b"[1]");
        assert_eq!(base, Fingerprint::of("POST", "/v1/charges", b"[1]"));
        assert_ne!(base, Fingerprint::of("POST", "/v1/refunds", b"[1]"));
        assert_ne!(base, Fingerprint::of("PUT", "/v1/charges", b"[1]"));
        assert_ne!(base, Fingerprint::of("POST", "/v1/charges", b"[2]"));
        assert_ne!(
            Fingerprint::of("a", "bc", b""),
            Fingerprint::of("ab", "c", b"")
        );
    }
}
