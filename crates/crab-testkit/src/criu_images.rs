//! Forging CRIU images for tests: a protobuf wire-level editor that changes chosen fields of
//! an image's entries and keeps every other byte (a decode and re-encode through message
//! structs would drop the fields they do not declare: registers, memory maps, …).
//!
//! An image is `[IMG_COMMON_MAGIC] type-magic (u32 len, message)*` (`crab_criu::images`);
//! [`edit_image`] hands each entry's message to a closure, [`edit_at`] walks into nested
//! messages by field number and [`set`] replaces a field's values.

use std::path::Path;

/// One protobuf field value, as on the wire.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Value {
    /// Wire type 0.
    Varint(u64),
    /// Wire type 1.
    Fixed64([u8; 8]),
    /// Wire type 2 (bytes, strings, nested messages, packed arrays).
    Bytes(Vec<u8>),
    /// Wire type 5.
    Fixed32([u8; 4]),
}

/// One field occurrence.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Field {
    /// Field number.
    pub tag: u32,
    /// Its value.
    pub value: Value,
}

fn varint(b: &[u8], at: &mut usize) -> u64 {
    let mut v = 0u64;
    let mut shift = 0;
    loop {
        let byte = b[*at];
        *at += 1;
        v |= u64::from(byte & 0x7f) << shift;
        if byte & 0x80 == 0 {
            return v;
        }
        shift += 7;
    }
}

fn put_varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

/// The fields of a message, in order (panics on malformed input: test code).
pub fn parse(b: &[u8]) -> Vec<Field> {
    let mut at = 0;
    let mut out = Vec::new();
    while at < b.len() {
        let key = varint(b, &mut at);
        let tag = (key >> 3) as u32;
        let value = match key & 7 {
            0 => Value::Varint(varint(b, &mut at)),
            1 => {
                let v = b[at..at + 8].try_into().expect("8 bytes");
                at += 8;
                Value::Fixed64(v)
            }
            2 => {
                let len = varint(b, &mut at) as usize;
                let v = b[at..at + len].to_vec();
                at += len;
                Value::Bytes(v)
            }
            5 => {
                let v = b[at..at + 4].try_into().expect("4 bytes");
                at += 4;
                Value::Fixed32(v)
            }
            w => panic!("wire type {w} at byte {at}"),
        };
        out.push(Field { tag, value });
    }
    out
}

/// The message of `fields`.
pub fn encode(fields: &[Field]) -> Vec<u8> {
    let mut out = Vec::new();
    for f in fields {
        let wt = match f.value {
            Value::Varint(_) => 0,
            Value::Fixed64(_) => 1,
            Value::Bytes(_) => 2,
            Value::Fixed32(_) => 5,
        };
        put_varint(&mut out, (u64::from(f.tag) << 3) | wt);
        match &f.value {
            Value::Varint(v) => put_varint(&mut out, *v),
            Value::Fixed64(v) => out.extend_from_slice(v),
            Value::Bytes(v) => {
                put_varint(&mut out, v.len() as u64);
                out.extend_from_slice(v);
            }
            Value::Fixed32(v) => out.extend_from_slice(v),
        }
    }
    out
}

/// Replace every occurrence of field `tag` by `values` (in place of the first, or at the end).
pub fn set(fields: &mut Vec<Field>, tag: u32, values: Vec<Value>) {
    let at = fields.iter().position(|f| f.tag == tag).unwrap_or(fields.len());
    fields.retain(|f| f.tag != tag);
    let at = at.min(fields.len());
    for (i, v) in values.into_iter().enumerate() {
        fields.insert(at + i, Field { tag, value: v });
    }
}

/// Apply `f` to the fields of the nested message reached by field numbers `path` (the first
/// occurrence at each level; panics when absent), re-encoding the way back up.
pub fn edit_at(msg: &[u8], path: &[u32], f: &mut dyn FnMut(&mut Vec<Field>)) -> Vec<u8> {
    let mut fields = parse(msg);
    match path.split_first() {
        None => f(&mut fields),
        Some((tag, rest)) => {
            let field = fields
                .iter_mut()
                .find(|x| x.tag == *tag)
                .unwrap_or_else(|| panic!("no field {tag} on the path"));
            let Value::Bytes(inner) = &field.value else { panic!("field {tag} is not a message") };
            field.value = Value::Bytes(edit_at(inner, rest, f));
        }
    }
    encode(&fields)
}

/// Rewrite image `path` (`magics`: 2 for most images, 1 for `inventory.img`) with each entry's
/// message passed through `f`.
pub fn edit_image(path: &Path, magics: usize, f: &mut dyn FnMut(&[u8]) -> Vec<u8>) {
    let b = std::fs::read(path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
    let head = 4 * magics;
    let mut out = b[..head].to_vec();
    let mut at = head;
    while at < b.len() {
        let len = u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes")) as usize;
        let msg = f(&b[at + 4..at + 4 + len]);
        out.extend_from_slice(&(msg.len() as u32).to_le_bytes());
        out.extend_from_slice(&msg);
        at += 4 + len;
    }
    std::fs::write(path, out).unwrap_or_else(|e| panic!("write {}: {e}", path.display()));
}

/// The process-image directory of point `p` (an entry of `crab --json checkpoints SB`) of
/// `sandbox` in state directory `state`.
pub fn proc_dir_of(state: &Path, sandbox: &str, p: &serde_json::Value) -> std::path::PathBuf {
    let parts = p["parts"].as_str().expect("the point lists its parts");
    let proc_id = parts.split('+').find(|x| x.starts_with('p')).expect("the point has processes");
    state.join("pool/checkpoints").join(sandbox).join("procs").join(proc_id)
}

/// Flip one byte of the memory image (`pages-*.img`) in `dir` or, for a store's `procs/`
/// directory, in one of its image directories; returns its path.
pub fn corrupt_pages(dir: &Path) -> std::path::PathBuf {
    let is_pages =
        |p: &Path| p.file_name().is_some_and(|n| n.to_string_lossy().starts_with("pages-"));
    let entries: Vec<std::path::PathBuf> = std::fs::read_dir(dir)
        .expect("reading the image directory")
        .flatten()
        .map(|e| e.path())
        .collect();
    let img = entries
        .iter()
        .find(|p| is_pages(p))
        .cloned()
        .or_else(|| {
            entries.iter().filter(|p| p.is_dir()).find_map(|d| {
                std::fs::read_dir(d).ok()?.flatten().map(|e| e.path()).find(|p| is_pages(p))
            })
        })
        .expect("no pages image");
    let mut bytes = std::fs::read(&img).expect("reading the pages image");
    bytes[0] ^= 0xff;
    std::fs::write(&img, bytes).expect("writing the pages image");
    img
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_and_encode_round_trip_and_edit_nested_fields() {
        let inner = encode(&[
            Field { tag: 11, value: Value::Varint(5) },
            Field { tag: 11, value: Value::Varint(0) },
            Field { tag: 18, value: Value::Varint(1) },
        ]);
        let outer = encode(&[
            Field { tag: 1, value: Value::Fixed64([1; 8]) },
            Field { tag: 10, value: Value::Bytes(inner) },
            Field { tag: 3, value: Value::Fixed32([2; 4]) },
        ]);
        assert_eq!(encode(&parse(&outer)), outer);
        let edited = edit_at(&outer, &[10], &mut |f| {
            set(f, 11, vec![Value::Varint(u64::from(u32::MAX)); 2])
        });
        let Value::Bytes(inner) = &parse(&edited)[1].value else { panic!() };
        let inner = parse(inner);
        assert_eq!(inner.len(), 3);
        assert!(inner[..2].iter().all(|f| f.value == Value::Varint(u64::from(u32::MAX))));
    }
}
