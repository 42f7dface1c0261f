//! Chat templates rendered with Hugging Face semantics.
//!
//! transformers renders `chat_template` with Jinja2 in a sandbox with `trim_blocks`,
//! `lstrip_blocks` and loop controls, passes `messages`, `add_generation_prompt` and the
//! special tokens from tokenizer_config.json, and adds `raise_exception`, `strftime_now` and a
//! `tojson` that writes Python's `json.dumps` (`", "` and `": "` separators, no HTML escaping).
//! minijinja with the pycompat string methods gives the same output for real templates; the
//! parity fixtures check it token for token.

use std::path::Path;

use minijinja::{Environment, ErrorKind, Value};
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Message {
    pub role: String,
    pub content: String,
}

impl Message {
    pub fn new(role: &str, content: &str) -> Self {
        Self { role: role.to_owned(), content: content.to_owned() }
    }
}

pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: Option<String>,
    eos_token: Option<String>,
}

const TEMPLATE_NAME: &str = "chat";

/// A special token in tokenizer_config.json: a string or an AddedToken object.
fn token_string(v: Option<&serde_json::Value>) -> Option<String> {
    match v? {
        serde_json::Value::String(s) => Some(s.clone()),
        serde_json::Value::Object(o) => o.get("content")?.as_str().map(str::to_owned),
        _ => None,
    }
}

impl ChatTemplate {
    /// The template from `chat_template.jinja` if present (it wins, as in transformers),
    /// otherwise from `tokenizer_config.json` (a string, or a list of named templates where
    /// "default" is used).
    pub fn load(jinja: Option<&Path>, tokenizer_config: Option<&Path>) -> Result<Option<Self>> {
        let tc: serde_json::Value = match tokenizer_config {
            Some(p) => {
                let text = std::fs::read_to_string(p).map_err(|e| Error::io(p, e))?;
                serde_json::from_str(&text)
                    .map_err(|e| Error::InvalidConfig { path: p.to_owned(), msg: e.to_string() })?
            }
            None => serde_json::Value::Null,
        };
        let source = match jinja {
            Some(p) => Some(std::fs::read_to_string(p).map_err(|e| Error::io(p, e))?),
            None => match tc.get("chat_template") {
                Some(serde_json::Value::String(s)) => Some(s.clone()),
                Some(serde_json::Value::Array(list)) => list
                    .iter()
                    .find(|t| t.get("name").and_then(|n| n.as_str()) == Some("default"))
                    .and_then(|t| t.get("template")?.as_str().map(str::to_owned)),
                _ => None,
            },
        };
        source.map(|s| Self::new(s, token_string(tc.get("bos_token")), token_string(tc.get("eos_token")))).transpose()
    }

    pub fn new(source: String, bos_token: Option<String>, eos_token: Option<String>) -> Result<Self> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", |msg: String| -> std::result::Result<Value, minijinja::Error> {
            Err(minijinja::Error::new(ErrorKind::InvalidOperation, msg))
        });
        env.add_function("strftime_now", |fmt: String| chrono::Local::now().format(&fmt).to_string());
        env.add_filter("tojson", tojson);
        // A model folder's template is untrusted input: bounded in steps and depth, its output
        // in size (render_with), so a hostile loop fails with a message instead of running for
        // hours or writing gigabytes; its memory by the allocator (a string doubled in a variable
        // costs one step whatever its length: folio_runtime::alloc_guard).
        env.set_fuel(Some(TEMPLATE_FUEL));
        env.set_recursion_limit(TEMPLATE_RECURSION);
        env.add_template_owned(TEMPLATE_NAME, source).map_err(|e| Error::Template(describe(&e)))?;
        Ok(Self { env, bos_token, eos_token })
    }

    pub fn render(&self, messages: &[Message], add_generation_prompt: bool) -> Result<String> {
        self.render_with(messages, add_generation_prompt, &serde_json::Map::new())
    }

    /// Renders with extra template variables, as `apply_chat_template(**kwargs)` passes them
    /// (`tools`, `enable_thinking`, `documents`, ...).
    pub fn render_with(
        &self,
        messages: &[Message],
        add_generation_prompt: bool,
        extra: &serde_json::Map<String, serde_json::Value>,
    ) -> Result<String> {
        let tmpl = self.env.get_template(TEMPLATE_NAME).map_err(|e| Error::Template(describe(&e)))?;
        let base = minijinja::context! {
            messages => messages,
            add_generation_prompt => add_generation_prompt,
            bos_token => self.bos_token.as_deref().unwrap_or(""),
            eos_token => self.eos_token.as_deref().unwrap_or(""),
        };
        let ctx = minijinja::context! { ..Value::from_serialize(extra), ..base };
        let mut out = Capped { bytes: Vec::new() };
        let rendered = folio_runtime::alloc_guard::guarded(TEMPLATE_MEMORY_BYTES, "the model's chat template", || {
            tmpl.render_captured_to(ctx, &mut out)
        });
        match rendered {
            Ok(_) => String::from_utf8(out.bytes).map_err(|e| Error::Template(e.to_string())),
            Err(_) if out.bytes.len() >= TEMPLATE_OUTPUT_BYTES => Err(Error::Template(format!(
                "the template wrote more than {} MiB, far more than any prompt the model reads: it is not a chat \
                 template Folio can use",
                TEMPLATE_OUTPUT_BYTES >> 20
            ))),
            Err(e) if e.kind() == ErrorKind::OutOfFuel => Err(Error::Template(format!(
                "the template ran more than {TEMPLATE_FUEL} steps without finishing (a loop that does not end, or \
                 one far too long for a prompt): it is not a chat template Folio can use"
            ))),
            Err(e) => Err(Error::Template(describe(&e))),
        }
    }
}

/// Steps a template may take to render one prompt: real templates take thousands per turn.
const TEMPLATE_FUEL: u64 = 50_000_000;
/// How deep its includes, macros and blocks may nest.
const TEMPLATE_RECURSION: usize = 100;
/// The largest prompt text a template may write (a million tokens is a few MiB).
const TEMPLATE_OUTPUT_BYTES: usize = 64 << 20;

/// The memory a rendering may take, its output included: real templates take kilobytes per
/// turn, a long conversation megabytes.
const TEMPLATE_MEMORY_BYTES: usize = 1 << 30;

/// A rendering's output, refused past [`TEMPLATE_OUTPUT_BYTES`].
struct Capped {
    bytes: Vec<u8>,
}

impl std::io::Write for Capped {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if self.bytes.len() + buf.len() > TEMPLATE_OUTPUT_BYTES {
            self.bytes.resize(TEMPLATE_OUTPUT_BYTES, 0);
            return Err(std::io::Error::other("the template's output is over its limit"));
        }
        self.bytes.extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// A template's own `raise_exception` message alone; other errors with their location.
fn describe(e: &minijinja::Error) -> String {
    match (e.kind(), e.detail()) {
        (ErrorKind::InvalidOperation, Some(msg)) => msg.to_owned(),
        _ => {
            let mut s = e.to_string();
            let mut src = std::error::Error::source(e);
            while let Some(inner) = src {
                s.push_str(&format!(": {inner}"));
                src = inner.source();
            }
            s
        }
    }
}

/// Python's `json.dumps(value, ensure_ascii=False, indent=indent)`.
fn tojson(value: Value, kwargs: minijinja::value::Kwargs) -> std::result::Result<Value, minijinja::Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    kwargs.assert_all_used()?;
    let json =
        serde_json::to_value(&value).map_err(|e| minijinja::Error::new(ErrorKind::InvalidOperation, e.to_string()))?;
    let mut out = Vec::new();
    let written = match indent {
        Some(n) => {
            let pad = vec![b' '; n];
            let mut ser =
                serde_json::Serializer::with_formatter(&mut out, serde_json::ser::PrettyFormatter::with_indent(&pad));
            json.serialize(&mut ser)
        }
        None => json.serialize(&mut serde_json::Serializer::with_formatter(&mut out, PyFormatter)),
    };
    written.map_err(|e| minijinja::Error::new(ErrorKind::InvalidOperation, e.to_string()))?;
    Ok(Value::from_safe_string(String::from_utf8(out).expect("serde_json writes UTF-8")))
}

/// serde_json formatter with Python's default separators `", "` and `": "`.
struct PyFormatter;

impl serde_json::ser::Formatter for PyFormatter {
    fn begin_array_value<W: ?Sized + std::io::Write>(&mut self, w: &mut W, first: bool) -> std::io::Result<()> {
        if first {
            Ok(())
        } else {
            w.write_all(b", ")
        }
    }
    fn begin_object_key<W: ?Sized + std::io::Write>(&mut self, w: &mut W, first: bool) -> std::io::Result<()> {
        if first {
            Ok(())
        } else {
            w.write_all(b", ")
        }
    }
    fn begin_object_value<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        w.write_all(b": ")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn render(src: &str, msgs: &[Message]) -> Result<String> {
        ChatTemplate::new(src.to_owned(), Some("<s>".into()), Some("</s>".into()))?.render(msgs, true)
    }

    #[test]
    fn hf_semantics() {
        let msgs = [Message::new("user", "  hi <b> \"x\"  ")];
        // trim_blocks + lstrip_blocks: block tag lines leave no whitespace behind; text lines keep theirs.
        let src = "{{ bos_token }}\n  {% for m in messages %}\n  [{{ m.role }}]{{ m.content | trim }}\n  {% endfor %}\n{% if add_generation_prompt %}>{% endif %}\n";
        assert_eq!(render(src, &msgs).unwrap(), "<s>\n  [user]hi <b> \"x\"\n>");
        // tojson writes Python's json.dumps, no HTML escaping.
        let out = render("{{ messages[0] | tojson }}", &msgs).unwrap();
        assert_eq!(out, r#"{"role": "user", "content": "  hi <b> \"x\"  "}"#);
        // Python string methods.
        let out = render("{{ messages[0].content.strip().split(' ')[0] }}{{ 'abc'.startswith('a') }}", &msgs).unwrap();
        assert_eq!(out, "hiTrue", "Python booleans print as True");
    }

    #[test]
    fn raise_exception_message_reaches_the_user() {
        let err = render("{{ raise_exception('Roles must alternate') }}", &[]).unwrap_err();
        assert_eq!(err.to_string(), "chat template: Roles must alternate");
    }
}
