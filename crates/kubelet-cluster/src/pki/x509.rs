//! The few facts the node reads from X.509 certificates: the subject's
//! common name and organizations (a client certificate's user and groups,
//! as the API server and the kubelet map them) and the validity period
//! (when a rotated certificate is renewed). A small DER reader of our own:
//! nothing else of the certificate is interpreted, and anything malformed
//! is an error value.

/// What went wrong reading a certificate.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("malformed certificate: {0}")]
pub struct X509Error(&'static str);

/// A certificate's subject and validity.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CertificateFacts {
    /// The subject's common name (2.5.4.3), if it has one.
    pub common_name: Option<String>,
    /// The subject's organizations (2.5.4.10), in order.
    pub organizations: Vec<String>,
    /// Not valid before this instant.
    pub not_before: jiff::Timestamp,
    /// Not valid after this instant.
    pub not_after: jiff::Timestamp,
}

/// One DER element: its tag and content.
struct Element<'a> {
    tag: u8,
    content: &'a [u8],
}

/// Reads the element at the start of `input`; returns it and the rest.
fn element(input: &[u8]) -> Result<(Element<'_>, &[u8]), X509Error> {
    let (&tag, rest) = input.split_first().ok_or(X509Error("truncated element"))?;
    if tag & 0x1f == 0x1f {
        return Err(X509Error("multi-byte tags are not used in certificates"));
    }
    let (&first, rest) = rest.split_first().ok_or(X509Error("truncated length"))?;
    let (length, rest) = if first < 0x80 {
        (usize::from(first), rest)
    } else {
        let count = usize::from(first & 0x7f);
        if count == 0 || count > 4 || rest.len() < count {
            return Err(X509Error("bad length"));
        }
        let length = rest[..count].iter().fold(0usize, |n, &b| (n << 8) | usize::from(b));
        (length, &rest[count..])
    };
    if rest.len() < length {
        return Err(X509Error("element longer than its container"));
    }
    Ok((Element { tag, content: &rest[..length] }, &rest[length..]))
}

/// Reads an element that must have `tag`.
fn expect<'a>(input: &'a [u8], tag: u8, what: &'static str) -> Result<(Element<'a>, &'a [u8]), X509Error> {
    let (found, rest) = element(input)?;
    if found.tag != tag {
        return Err(X509Error(what));
    }
    Ok((found, rest))
}

const SEQUENCE: u8 = 0x30;
const SET: u8 = 0x31;
const OID: u8 = 0x06;
const UTC_TIME: u8 = 0x17;
const GENERALIZED_TIME: u8 = 0x18;
/// 2.5.4.3
const OID_COMMON_NAME: &[u8] = &[0x55, 0x04, 0x03];
/// 2.5.4.10
const OID_ORGANIZATION: &[u8] = &[0x55, 0x04, 0x0a];

/// Reads the subject and validity of a DER certificate.
pub fn certificate_facts(der: &[u8]) -> Result<CertificateFacts, X509Error> {
    let (certificate, _) = expect(der, SEQUENCE, "not a certificate")?;
    let (tbs, _) = expect(certificate.content, SEQUENCE, "no tbsCertificate")?;
    let mut rest = tbs.content;
    // [0] EXPLICIT version, optional.
    if rest.first() == Some(&0xa0) {
        rest = element(rest)?.1;
    }
    let (_serial, rest) = expect(rest, 0x02, "no serial number")?;
    let (_signature, rest) = expect(rest, SEQUENCE, "no signature algorithm")?;
    let (_issuer, rest) = expect(rest, SEQUENCE, "no issuer")?;
    let (validity, rest) = expect(rest, SEQUENCE, "no validity")?;
    let (subject, _) = expect(rest, SEQUENCE, "no subject")?;
    let (not_before, after) = element(validity.content)?;
    let (not_after, _) = element(after)?;
    let mut facts = CertificateFacts {
        common_name: None,
        organizations: Vec::new(),
        not_before: time(&not_before)?,
        not_after: time(&not_after)?,
    };
    let mut names = subject.content;
    while !names.is_empty() {
        let (set, next) = expect(names, SET, "bad relative distinguished name")?;
        names = next;
        let mut attributes = set.content;
        while !attributes.is_empty() {
            let (attribute, next) = expect(attributes, SEQUENCE, "bad attribute")?;
            attributes = next;
            let (oid, value) = expect(attribute.content, OID, "attribute without type")?;
            let (value, _) = element(value)?;
            let text = String::from_utf8_lossy(value.content).into_owned();
            if oid.content == OID_COMMON_NAME {
                facts.common_name = Some(text);
            } else if oid.content == OID_ORGANIZATION {
                facts.organizations.push(text);
            }
        }
    }
    Ok(facts)
}

/// A UTCTime (`YYMMDDHHMMSSZ`) or GeneralizedTime (`YYYYMMDDHHMMSSZ`).
fn time(element: &Element<'_>) -> Result<jiff::Timestamp, X509Error> {
    let text = std::str::from_utf8(element.content).map_err(|_| X509Error("time is not text"))?;
    if !text.is_ascii() {
        return Err(X509Error("bad validity time"));
    }
    let full = match element.tag {
        UTC_TIME if text.len() == 13 => {
            let year: u32 = text[..2].parse().map_err(|_| X509Error("bad UTCTime"))?;
            // RFC 5280: 50–99 are 19xx, 00–49 are 20xx.
            format!("{}{}", if year >= 50 { "19" } else { "20" }, text)
        }
        GENERALIZED_TIME if text.len() == 15 => text.to_owned(),
        _ => return Err(X509Error("bad validity time")),
    };
    let digits = full.strip_suffix('Z').ok_or(X509Error("validity time is not UTC"))?;
    if !digits.bytes().all(|b| b.is_ascii_digit()) {
        return Err(X509Error("bad validity time"));
    }
    let iso = format!(
        "{}-{}-{}T{}:{}:{}Z",
        &digits[..4],
        &digits[4..6],
        &digits[6..8],
        &digits[8..10],
        &digits[10..12],
        &digits[12..14]
    );
    iso.parse().map_err(|_| X509Error("bad validity time"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_subject_and_validity_of_a_generated_certificate() {
        let key = rcgen::KeyPair::generate().expect("key");
        let mut params = rcgen::CertificateParams::new(vec!["node-a".to_owned()]).expect("params");
        params.distinguished_name.push(rcgen::DnType::CommonName, "system:node:node-a");
        params.distinguished_name.push(rcgen::DnType::OrganizationName, "system:nodes");
        params.not_before = rcgen::date_time_ymd(2026, 1, 2);
        params.not_after = rcgen::date_time_ymd(2051, 3, 4);
        let certificate = params.self_signed(&key).expect("certificate");
        let facts = certificate_facts(certificate.der()).expect("facts");
        assert_eq!(facts.common_name.as_deref(), Some("system:node:node-a"));
        assert_eq!(facts.organizations, ["system:nodes"]);
        assert_eq!(facts.not_before.to_string(), "2026-01-02T00:00:00Z");
        assert_eq!(facts.not_after.to_string(), "2051-03-04T00:00:00Z");
    }

    #[test]
    fn garbage_is_an_error() {
        assert!(certificate_facts(b"").is_err());
        assert!(certificate_facts(&[0x30, 0x82, 0xff]).is_err());
        assert!(certificate_facts(&[0x30, 0x03, 0x02, 0x01, 0x00]).is_err());
    }
}
