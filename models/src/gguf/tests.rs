//! GGUF files against their references (tests/fixtures/gguf, made by
//! tools/make_gguf_fixtures.py): llama.cpp's logits, greedy tokens and tokenization of each
//! file, and a float64 decoder's logits over the file's own F16/BF16 weights.

use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use serde_json::Value;

use crate::attention::Dense;
use crate::model::Logits;
use crate::Engine;

/// F16/BF16 files against the float64 decoder over the same rounded weights (the model's own
/// arithmetic in f32 on the CPU).
const EXACT_TOLERANCE: f32 = 1e-3;
/// Quantized files against llama.cpp's logits for the same file, on logits up to 4.5: both
/// round the activations to 8 bits for each product, llama.cpp in ggml's blocks, candle's x86
/// path in its own for Q8_0 and Q4_K (bit-equal to llama.cpp's for Q4_0, Q5_K, Q6_K); the
/// measured differences are in docs/gguf.md.
const QUANT_TOLERANCE: f32 = 0.25;
/// Logit differences below this are float rounding over a prompt of 60-odd tokens (sums in
/// another order), whatever the arithmetic.
const MIN_MARGIN: f32 = 1e-2;
/// Folio's distance from the dequantized weights' logits, at most this times llama.cpp's.
const FAITHFUL_RATIO: f32 = 2.0;
/// The fixture with a SentencePiece vocabulary.
const SPM_FIXTURE: &str = "mistral-spm-f16.gguf";
/// Copies of a 58-byte sentence in one line past the 1 MiB a text is tokenized whole within.
const LONG_LINE_REPEATS: usize = 18_500;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/gguf")
}

fn reference() -> Value {
    serde_json::from_str(&std::fs::read_to_string(fixtures().join("reference.json")).unwrap()).unwrap()
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

fn rows(v: &Value) -> Vec<Vec<f32>> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|r| r.as_array().unwrap().iter().map(|x| x.as_f64().unwrap() as f32).collect())
        .collect()
}

fn load(file: &str) -> Engine {
    Engine::load(fixtures().join(file).to_str().unwrap(), &Device::Cpu, DType::F32).unwrap()
}

/// The last `n` rows of the logits of `ids`, one forward pass.
fn last_logits(engine: &Engine, ids: &[u32], n: usize) -> Vec<Vec<f32>> {
    let mut kv = engine.model.new_kv();
    let logits: Tensor = engine.model.forward(ids, &mut kv, &Dense, Logits::All).unwrap();
    let all = logits.to_vec2::<f32>().unwrap();
    all[all.len() - n..].to_vec()
}

fn max_abs(a: &[Vec<f32>], b: &[Vec<f32>]) -> f32 {
    a.iter().zip(b).flat_map(|(x, y)| x.iter().zip(y).map(|(p, q)| (p - q).abs())).fold(0.0, f32::max)
}

#[test]
fn f16_and_bf16_files_match_the_float64_decoder_over_their_weights() {
    let r = reference();
    for (file, entry) in r["files"].as_object().unwrap() {
        let Some(numpy) = entry["logits"].get("numpy_last_rows") else { continue };
        let engine = load(file);
        let want = rows(numpy);
        let got = last_logits(&engine, &ids(&entry["logits"]["input_ids"]), want.len());
        let diff = max_abs(&got, &want);
        assert!(diff < EXACT_TOLERANCE, "{file}: logits differ from the float64 decoder by {diff}");
        let llama = max_abs(&got, &rows(&entry["logits"]["last_rows"]));
        eprintln!("{file}: vs float64 {diff:.2e}, vs llama.cpp {llama:.2e}");
    }
}

#[test]
fn quantized_files_match_llama_cpp() {
    let r = reference();
    let mut checked = 0;
    for (file, entry) in r["files"].as_object().unwrap() {
        let Some(dequantized) = entry["logits"].get("dequantized_last_rows") else { continue };
        let engine = load(file);
        let want = rows(&entry["logits"]["last_rows"]);
        let got = last_logits(&engine, &ids(&entry["logits"]["input_ids"]), want.len());
        let diff = max_abs(&got, &want);
        assert!(diff < QUANT_TOLERANCE, "{file}: logits differ from llama.cpp's by {diff}");
        // As faithful to the file's weights as llama.cpp: both against the same products
        // without the activations' rounding.
        let ours = max_abs(&got, &rows(dequantized));
        let theirs = entry["llama_cpp_max_abs_vs_dequantized"].as_f64().unwrap() as f32;
        assert!(
            ours < FAITHFUL_RATIO * theirs,
            "{file}: {ours} from the dequantized weights' logits, llama.cpp {theirs}"
        );
        // Teacher-forced on llama.cpp's greedy text: our argmax is its token at every step
        // where its top two are further apart than twice the difference measured above (the
        // files whose arithmetic is llama.cpp's to the bit are held to every step with a margin
        // over MIN_MARGIN).
        let flip = 2.0 * diff.max(MIN_MARGIN);
        let prompt = ids(&entry["greedy"]["prompt_ids"]);
        let text = ids(&entry["greedy"]["new_tokens"]);
        let margins: Vec<f32> =
            entry["greedy"]["top2_margins"].as_array().unwrap().iter().map(|m| m.as_f64().unwrap() as f32).collect();
        let forced: Vec<u32> = prompt.iter().chain(&text[..text.len() - 1]).copied().collect();
        let steps = last_logits(&engine, &forced, text.len());
        let mut decided = 0;
        for (i, row) in steps.iter().enumerate() {
            if margins[i] < flip {
                continue;
            }
            let best = (0..row.len()).max_by(|&a, &b| row[a].total_cmp(&row[b])).unwrap() as u32;
            assert_eq!(best, text[i], "{file}: step {i} (llama.cpp's margin {})", margins[i]);
            decided += 1;
        }
        eprintln!(
            "{file}: vs llama.cpp {diff:.3}, vs the dequantized weights {ours:.3} (llama.cpp {theirs:.3}); \
             greedy equal at {decided} of {} steps (the rest within the margin)",
            text.len()
        );
        checked += 1;
    }
    assert_eq!(checked, 5, "the five quantisations of llama256");
}

#[test]
fn the_tokenizer_from_metadata_tokenizes_as_llama_cpp() {
    let r = reference();
    for (file, entry) in r["files"].as_object().unwrap() {
        let engine = load(file);
        for case in entry["tokens"].as_array().unwrap() {
            let text = case["text"].as_str().unwrap();
            assert_eq!(engine.tokenizer.encode_prompt(text).unwrap(), ids(&case["ids"]), "{file}: {text:?}");
        }
    }
}

/// The SentencePiece fixture: its tokens decode back to the text for every case without control
/// tokens (the `▁` in front taken off, bytes fused back into characters), and a text with a line too long to tokenize whole is
/// tokenized in pieces to the same ids as whole (no `▁` put in front of a continuation).
#[test]
fn a_sentencepiece_vocabulary_decodes_and_tokenizes_long_lines_as_whole() {
    let engine = load(SPM_FIXTURE);
    let t = &engine.tokenizer;
    let r = reference();
    let cases = r["files"][SPM_FIXTURE]["tokens"].as_array().expect("the SentencePiece fixture's cases");
    for case in cases.iter().map(|c| c["text"].as_str().unwrap()).filter(|c| !c.contains("<s>")) {
        let ids = t.encode_prompt(case).unwrap();
        assert_eq!(t.decode(&ids, false).unwrap(), case, "{ids:?}");
    }
    let sentence = cases[0]["text"].as_str().unwrap();
    let long = std::iter::repeat_n(sentence, LONG_LINE_REPEATS).collect::<Vec<_>>().join("  ");
    assert!(!long.contains('\n') && long.len() > (1 << 20), "one line longer than the whole-text limit");
    assert_eq!(t.encode_text(&long).unwrap(), t.encode_prompt(&long).unwrap());
}

/// A document in a context of the SentencePiece fixture takes the tokens of its text: each piece
/// (the template's text, the title, the path, the text) continues the prompt, so no `▁` is put
/// in front of each — the document's tokens are those of the template filled in, tokenized as a
/// continuation (the fixture's 512-token context is too short for a whole context's plan).
#[test]
fn a_sentencepiece_document_has_no_spaces_between_its_pieces() {
    let engine = load(SPM_FIXTURE);
    let text = "Hello world.\nThe theater then.";
    let doc = crate::context::DocumentText {
        title: "Notes".into(),
        path: "notes/a.txt".into(),
        bytes: text.len() as u64,
        xxh3: crate::context::format::checksum(text.as_bytes()),
        kind: "text".into(),
        text: text.into(),
        parts: Vec::new(),
    };
    let counted = engine.document_tokens(std::slice::from_ref(&doc), &|_| {}).unwrap()[0].tokens;
    let filled =
        engine.document_template().replace("{title}", &doc.title).replace("{path}", &doc.path).replace("{text}", text);
    let whole = engine.tokenizer.encode_prompt_continued(&filled).unwrap();
    assert_eq!(counted, whole.len(), "{filled:?}: {:?}", engine.tokenizer.decode(&whole, false));
}

/// A copy of the qwen2 fixture with its metadata edited, written by candle's GGUF writer.
fn edited(
    dir: &Path,
    name: &str,
    edit: impl Fn(&mut std::collections::HashMap<String, candle_core::quantized::gguf_file::Value>),
) -> PathBuf {
    use candle_core::quantized::gguf_file;
    let src = fixtures().join("qwen2-f16.gguf");
    let mut reader = std::fs::File::open(&src).unwrap();
    let mut content = gguf_file::Content::read(&mut reader).unwrap();
    let names: Vec<String> = content.tensor_infos.keys().cloned().collect();
    let tensors: Vec<_> = names.iter().map(|n| content.tensor(&mut reader, n, &Device::Cpu).unwrap()).collect();
    edit(&mut content.metadata);
    let metadata: Vec<(&str, &gguf_file::Value)> = content.metadata.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let tensors: Vec<(&str, &candle_core::quantized::QTensor)> =
        names.iter().map(String::as_str).zip(&tensors).collect();
    let path = dir.join(name);
    gguf_file::write(&mut std::fs::File::create(&path).unwrap(), &metadata, &tensors).unwrap();
    path
}

/// The header bytes of tensor `name`'s entry: where its type and offset fields start.
fn tensor_entry(bytes: &[u8], name: &str) -> (usize, usize) {
    let key = [&(name.len() as u64).to_le_bytes()[..], name.as_bytes()].concat();
    let at = bytes.windows(key.len()).position(|w| w == key).expect("tensor entry") + key.len();
    let dims = u32::from_le_bytes(bytes[at..at + 4].try_into().unwrap()) as usize;
    let type_at = at + 4 + 8 * dims;
    (type_at, type_at + 4)
}

fn open_error(path: &Path) -> String {
    match Engine::load(path.to_str().unwrap(), &Device::Cpu, DType::F32) {
        Ok(_) => panic!("{} loaded", path.display()),
        Err(e) => e.to_string(),
    }
}

#[test]
fn bad_files_are_refused_each_with_its_own_reason() {
    use candle_core::quantized::gguf_file::Value as V;
    let dir = tempfile::tempdir().unwrap();
    let good = std::fs::read(fixtures().join("qwen2-f16.gguf")).unwrap();
    let write = |name: &str, bytes: &[u8]| {
        let p = dir.path().join(name);
        std::fs::write(&p, bytes).unwrap();
        p
    };
    let expect = |path: PathBuf, words: &[&str]| {
        let msg = open_error(&path);
        eprintln!("{msg}");
        for w in words {
            assert!(msg.contains(w), "{}: {msg:?} lacks {w:?}", path.display());
        }
        assert!(msg.contains(path.file_name().unwrap().to_str().unwrap()), "{msg:?} names the file");
    };
    expect(write("header-cut.gguf", &good[..200]), &["ends inside its header", "truncated"]);
    expect(write("data-cut.gguf", &good[..good.len() - 4096]), &["its tensors claim", "truncated"]);
    expect(write("not-gguf.gguf", b"PK\x03\x04 a zip file, not a model"), &["not a GGUF model file"]);
    let mut far = good.clone();
    let (_, offset_at) = tensor_entry(&far, "blk.1.ffn_up.weight");
    far[offset_at..offset_at + 8].copy_from_slice(&(1u64 << 40).to_le_bytes());
    expect(write("claims-more.gguf", &far), &["its tensors claim", "blk.1.ffn_up.weight ends past the end"]);
    let mut iq = good.clone();
    let (type_at, _) = tensor_entry(&iq, "blk.0.ffn_down.weight");
    iq[type_at..type_at + 4].copy_from_slice(&23u32.to_le_bytes());
    expect(write("iq4.gguf", &iq), &["quantized as IQ4_XS", "Q4_K"]);
    let arch = edited(dir.path(), "arch.gguf", |m| {
        m.insert("general.architecture".into(), V::String("gptneox".into()));
    });
    expect(arch, &["architecture \"gptneox\"", "llama, qwen2, qwen3"]);
    let no_vocab = edited(dir.path(), "no-vocab.gguf", |m| {
        m.remove("tokenizer.ggml.tokens");
    });
    expect(no_vocab, &["has no tokenizer", "tokenizer.ggml.tokens"]);
    let spm = edited(dir.path(), "spm.gguf", |m| {
        m.insert("tokenizer.ggml.model".into(), V::String("llama".into()));
    });
    expect(spm, &["SentencePiece vocabulary has no scores", "tokenizer.ggml.scores"]);
    let rwkv = edited(dir.path(), "rwkv.gguf", |m| {
        m.insert("tokenizer.ggml.model".into(), V::String("rwkv".into()));
    });
    expect(rwkv, &["its tokenizer is \"rwkv\"", "byte-level BPE", "SentencePiece"]);
    let shape = edited(dir.path(), "shape.gguf", |m| {
        m.insert("qwen2.feed_forward_length".into(), V::U32(256));
    });
    expect(shape, &["tensor blk.0.ffn_gate.weight has shape [128, 64]", "metadata implies [256, 64]"]);
    let heads = edited(dir.path(), "heads.gguf", |m| {
        m.insert("qwen2.attention.head_count_kv".into(), V::U32(3));
    });
    expect(heads, &["the attention heads (4) must be a multiple of the key/value heads (3)"]);
    let aligned = edited(dir.path(), "alignment.gguf", |m| {
        m.insert("general.alignment".into(), V::U32(0));
    });
    expect(aligned, &["its header is damaged"]);
    // The untouched file, rewritten the same way, loads: the edits are what is refused.
    Engine::load(edited(dir.path(), "same.gguf", |_| {}).to_str().unwrap(), &Device::Cpu, DType::F32).unwrap();
}
