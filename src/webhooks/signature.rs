//! The `Stripe-Signature` header: `t=<unix seconds>,v1=<hex HMAC-SHA256>`,
//! the HMAC keyed with the endpoint's secret (`whsec_...`, used as written)
//! over `"<t>.<payload>"`. It is what the official SDKs' `constructEvent`
//! checks, so a receiver verifies oncepay's webhooks as it would Stripe's.
//! The timestamp is signed too, so a captured delivery cannot be replayed
//! once it is older than the receiver's tolerance.

use hmac::{Hmac, Mac};
use sha2::Sha256;

/// The header's name.
pub const HEADER: &str = "stripe-signature";

/// How old a signature a receiver accepts by default: five minutes, as the SDKs do.
pub const DEFAULT_TOLERANCE_SECS: i64 = 300;

fn mac(secret: &str, timestamp: i64, payload: &[u8]) -> Hmac<Sha256> {
    let mut mac = Hmac::<Sha256>::new_from_slice(secret.as_bytes()).expect("HMAC takes any key");
    mac.update(timestamp.to_string().as_bytes());
    mac.update(b".");
    mac.update(payload);
    mac
}

/// The header value that signs `payload` at `timestamp` with `secret`.
pub fn sign(secret: &str, timestamp: i64, payload: &[u8]) -> String {
    let digest = mac(secret, timestamp, payload).finalize().into_bytes();
    format!("t={timestamp},v1={}", hex::encode(digest))
}

/// Why a signature was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum VerifyError {
    #[error("no Stripe-Signature header")]
    Missing,
    #[error("the Stripe-Signature header has no timestamp or no v1 signature")]
    Malformed,
    #[error("no v1 signature matches the payload")]
    NoMatch,
    #[error("the signature's timestamp is outside the tolerance")]
    OutsideTolerance,
}

/// Checks a `Stripe-Signature` header against `payload` and `secret`, as
/// the SDKs do: some `v1` must be the HMAC (compared in constant time), and
/// `t` within `tolerance_secs` of `now`. The bytes must be the body exactly
/// as received: a parsed and re-serialised body does not verify.
pub fn verify(
    header: Option<&str>,
    payload: &[u8],
    secret: &str,
    now: i64,
    tolerance_secs: i64,
) -> Result<(), VerifyError> {
    let header = header.ok_or(VerifyError::Missing)?;
    let mut timestamp = None;
    let mut signatures = Vec::new();
    for part in header.split(',') {
        match part.trim().split_once('=') {
            Some(("t", t)) => timestamp = t.parse::<i64>().ok(),
            Some(("v1", v1)) => signatures.extend(hex::decode(v1).ok()),
            _ => {}
        }
    }
    let timestamp = timestamp.ok_or(VerifyError::Malformed)?;
    if signatures.is_empty() {
        return Err(VerifyError::Malformed);
    }
    let expected = mac(secret, timestamp, payload);
    if !signatures
        .iter()
        .any(|s| expected.clone().verify_slice(s).is_ok())
    {
        return Err(VerifyError::NoMatch);
    }
    if (now - timestamp).abs() > tolerance_secs {
        return Err(VerifyError::OutsideTolerance);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const SECRET: &str = "whsec_test0000000000000000000000000";

    #[test]
    fn the_signature_is_the_hmac_of_the_timestamp_a_dot_and_the_payload() {
        // Computed independently: printf '1700000000.{"id":"evt_1"}' |
        //   openssl dgst -sha256 -hmac whsec_test0000000000000000000000000
        let header = sign(SECRET, 1_700_000_000, br#"{"id":"evt_1"}"#);
        assert_eq!(
            header,
            "t=1700000000,v1=39898e2f038c693a4696047a779465916d847364b8ccaa72fc2912e9ea3a2546"
        );
    }

    #[test]
    fn a_signed_payload_verifies_and_any_change_is_refused() {
        let payload = br#"{"id":"evt_1","type":"charge.succeeded"}"#;
        let header = sign(SECRET, 1_000, payload);
        assert_eq!(verify(Some(&header), payload, SECRET, 1_000, 300), Ok(()));
        assert_eq!(verify(Some(&header), payload, SECRET, 1_300, 300), Ok(()));
        assert_eq!(
            verify(Some(&header), br#"{"id":"evt_2"}"#, SECRET, 1_000, 300),
            Err(VerifyError::NoMatch)
        );
        assert_eq!(
            verify(Some(&header), payload, "whsec_other", 1_000, 300),
            Err(VerifyError::NoMatch)
        );
        assert_eq!(
            verify(Some(&header), payload, SECRET, 1_301, 300),
            Err(VerifyError::OutsideTolerance)
        );
        // The timestamp is signed: moving it breaks the signature.
        let moved = header.replace("t=1000", "t=1299");
        assert_eq!(
            verify(Some(&moved), payload, SECRET, 1_299, 300),
            Err(VerifyError::NoMatch)
        );
        assert_eq!(
            verify(None, payload, SECRET, 1_000, 300),
            Err(VerifyError::Missing)
        );
        assert_eq!(
            verify(Some("v1=00"), payload, SECRET, 1_000, 300),
            Err(VerifyError::Malformed)
        );
        // Among other schemes and signatures, one good v1 is enough.
        let several = format!("t=1000,v0=abc,v1=00ff,{}", &header["t=1000,".len()..]);
        assert_eq!(verify(Some(&several), payload, SECRET, 1_000, 300), Ok(()));
    }
}
