//! The sha256 a server vouches for, from whichever header it puts it in: Hugging Face's
//! `X-Linked-Etag` (the Git LFS object id), an ETag that is a bare sha256, `Repr-Digest`
//! (RFC 9530), the older `Digest` (RFC 3230), or `X-Checksum-Sha256` (artifact servers).

use base64::Engine;
use ureq::http::HeaderMap;

/// Git's object id of a file's bytes: sha1 of `blob <len>\0` and the bytes (Hugging Face's
/// ETag of a file kept in git rather than LFS), lowercase hex.
pub fn git_blob_id(bytes: &[u8]) -> String {
    use sha1::Digest as _;
    let mut hasher = sha1::Sha1::new();
    hasher.update(format!("blob {}\0", bytes.len()).as_bytes());
    hasher.update(bytes);
    crate::download::hex(&hasher.finalize())
}

/// Lowercase hex of a 64-digit hex string (quotes and a `W/` prefix stripped), if it is one.
pub fn sha256_hex(text: &str) -> Option<String> {
    let text = text.trim().trim_start_matches("W/").trim_matches('"');
    (text.len() == 64 && text.bytes().all(|b| b.is_ascii_hexdigit()))
        .then(|| text.to_ascii_lowercase())
}

/// `sha-256=:BASE64:` (Repr-Digest) or `SHA-256=BASE64` (Digest) among comma-separated
/// entries, as lowercase hex.
fn sha256_from_digest_field(text: &str) -> Option<String> {
    text.split(',').find_map(|entry| {
        let (algorithm, value) = entry.trim().split_once('=')?;
        if !algorithm.trim().eq_ignore_ascii_case("sha-256") {
            return None;
        }
        let value = value.trim().trim_matches(':');
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(value)
            .ok()
            .filter(|b| b.len() == 32)?;
        Some(bytes.iter().map(|b| format!("{b:02x}")).collect())
    })
}

/// The sha256 the response's headers give for the whole file, with the header's name.
pub fn sha256_from_headers(headers: &HeaderMap) -> Option<(String, &'static str)> {
    let get = |name: &str| headers.get(name).and_then(|v| v.to_str().ok());
    if let Some(hex) = get("x-linked-etag").and_then(sha256_hex) {
        return Some((hex, "the X-Linked-Etag header (Git LFS sha256)"));
    }
    if let Some(hex) = get("repr-digest").and_then(sha256_from_digest_field) {
        return Some((hex, "the Repr-Digest header"));
    }
    if let Some(hex) = get("digest").and_then(sha256_from_digest_field) {
        return Some((hex, "the Digest header"));
    }
    if let Some(hex) = get("x-checksum-sha256").and_then(sha256_hex) {
        return Some((hex, "the X-Checksum-Sha256 header"));
    }
    // Only a strong ETag is the file's own hash; a weak one names a representation.
    if let Some(hex) = get("etag")
        .filter(|e| !e.starts_with("W/"))
        .and_then(sha256_hex)
    {
        return Some((hex, "the ETag header (a sha256)"));
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    const HEX: &str = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53";

    fn headers(pairs: &[(&'static str, String)]) -> HeaderMap {
        let mut map = HeaderMap::new();
        for (k, v) in pairs {
            map.insert(*k, v.parse().unwrap());
        }
        map
    }

    #[test]
    fn each_header_form_gives_the_same_hex() {
        let bytes: Vec<u8> = (0..32)
            .map(|i| u8::from_str_radix(&HEX[2 * i..2 * i + 2], 16).unwrap())
            .collect();
        let b64 = base64::engine::general_purpose::STANDARD.encode(&bytes);
        for (name, value) in [
            ("x-linked-etag", format!("\"{HEX}\"")),
            ("repr-digest", format!("md5=:AAAA:, sha-256=:{b64}:")),
            ("digest", format!("SHA-256={b64}")),
            ("x-checksum-sha256", HEX.to_uppercase()),
            ("etag", format!("\"{HEX}\"")),
        ] {
            let found = sha256_from_headers(&headers(&[(name, value.clone())]));
            assert_eq!(
                found.as_ref().map(|f| f.0.as_str()),
                Some(HEX),
                "{name}: {value}"
            );
        }
    }

    #[test]
    fn git_blob_ids_match_git() {
        // `printf 'hello\n' | git hash-object --stdin`
        assert_eq!(
            git_blob_id(b"hello\n"),
            "ce013625030ba8dba906f756967f9e9ca394464a"
        );
    }

    #[test]
    fn git_sha1_and_weak_etags_are_not_sha256() {
        let sha1 = "a".repeat(40);
        assert_eq!(
            sha256_from_headers(&headers(&[("etag", format!("\"{sha1}\""))])),
            None
        );
        assert_eq!(
            sha256_from_headers(&headers(&[("etag", format!("W/\"{HEX}\""))])),
            None
        );
        assert_eq!(
            sha256_from_headers(&headers(&[("digest", "sha-256=notbase64".into())])),
            None
        );
    }
}
