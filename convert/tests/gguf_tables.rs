//! Corrupted GGUF tensor tables (offsets, types, dimensions, counts, the data section's
//! length): every one is refused with an error, or converts to exactly the model the intact
//! file converts to. Never a panic, never a different model.

use gdsllm_convert::convert::{ConvertOptions, NoProgress, convert};
use gdsllm_convert::testing::{TableMutation, TinyLlama, dir_files as files, tensor_infos_at};
use proptest::prelude::*;
use weights_format::DType;

/// Cases per run: small in CI, more with `GDSLLM_PROPTEST_CASES`.
fn cases() -> u32 {
    std::env::var("GDSLLM_PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(128)
}

struct Fixture {
    _tmp: tempfile::TempDir,
    bytes: Vec<u8>,
    names: Vec<String>,
    reference: Vec<(String, Vec<u8>)>,
}

fn fixture(dtype: DType) -> Fixture {
    let tmp = tempfile::tempdir().unwrap();
    let builder = TinyLlama::new(7, false).gguf(dtype);
    let bytes = builder.to_bytes();
    let input = tmp.path().join("model.gguf");
    std::fs::write(&input, &bytes).unwrap();
    let out = tmp.path().join("reference");
    convert(&input, &out, &ConvertOptions::default(), &NoProgress).unwrap();
    Fixture {
        reference: files(&out),
        names: builder.tensor_names(),
        bytes,
        _tmp: tmp,
    }
}

/// Converts the mutated file; Ok(true) when the conversion succeeded with the reference's
/// exact bytes, Ok(false) when it was refused.
fn outcome(fixture: &Fixture, mutation: &TableMutation) -> Result<bool, String> {
    let infos = tensor_infos_at(&fixture.bytes, &fixture.names);
    let mut bytes = fixture.bytes.clone();
    mutation.apply(&mut bytes, &infos);
    let tmp = tempfile::tempdir().unwrap();
    let input = tmp.path().join("model.gguf");
    std::fs::write(&input, &bytes).unwrap();
    let out = tmp.path().join("out");
    match convert(&input, &out, &ConvertOptions::default(), &NoProgress) {
        Err(err) => {
            let message = err.to_string();
            if message.is_empty() {
                return Err(format!("{mutation:?}: an empty error message"));
            }
            assert!(
                !out.exists(),
                "{mutation:?}: refused but left {}",
                out.display()
            );
            Ok(false)
        }
        Ok(_) if bytes == fixture.bytes || files(&out) == fixture.reference => Ok(true),
        Ok(_) => Err(format!(
            "{mutation:?}: converted without error into a different model"
        )),
    }
}

#[test]
fn the_attacks_of_issue_17_are_refused() {
    let fixture = fixture(DType::F32);
    let infos = tensor_infos_at(&fixture.bytes, &fixture.names);
    let norm = infos
        .iter()
        .position(|i| i.name == "blk.0.attn_norm.weight")
        .unwrap();
    for mutation in [
        // Overlap: a tensor's offset set to 0.
        TableMutation::Offset {
            tensor: 3,
            value: 0,
        },
        // A type lie: F32 declared as F16 (half the bytes).
        TableMutation::Type {
            tensor: norm,
            value: 1,
        },
        // The last tensor's type changed: bytes left over after the data section.
        TableMutation::Type {
            tensor: infos.len() - 1,
            value: 1,
        },
        // A gap before a tensor.
        TableMutation::Offset {
            tensor: 2,
            value: infos[2].offset + 32,
        },
    ] {
        assert_eq!(outcome(&fixture, &mutation), Ok(false), "{mutation:?}");
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(cases()))]

    #[test]
    fn corrupted_tensor_tables_are_refused_or_harmless(seed in any::<u64>(), quantized in any::<bool>()) {
        let fixture = if quantized { &*Q8_FIXTURE } else { &*F32_FIXTURE };
        let infos = tensor_infos_at(&fixture.bytes, &fixture.names);
        let mutation = TableMutation::from_seed(seed, &infos);
        if let Err(e) = outcome(fixture, &mutation) {
            prop_assert!(false, "{}", e);
        }
    }
}

static F32_FIXTURE: std::sync::LazyLock<Fixture> = std::sync::LazyLock::new(|| fixture(DType::F32));
static Q8_FIXTURE: std::sync::LazyLock<Fixture> = std::sync::LazyLock::new(|| fixture(DType::Q8_0));
