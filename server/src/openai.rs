//! OpenAI's wire format, as far as Folio honours it. Requests are read strictly: an argument
//! Folio would have to ignore (logprobs, tools, n > 1, penalties other than 0) is refused with
//! its name, as OpenAI refuses an unknown one, because an answer made without what the client
//! asked for is a silent lie. `folio` is the one extension: the attention method and its
//! budget (`{"folio": {"method": "hip:2048"}}`), the context's default when absent.

use serde::Deserialize;
use serde_json::{json, Value};

use crate::error::ApiError;
use folio_models::chat::Message;
use folio_models::generate::StopReason;

/// OpenAI's limit on stop sequences.
const MAX_STOPS: usize = 4;

/// A `stop` argument: one string or several.
#[derive(Deserialize)]
#[serde(untagged)]
pub enum Stop {
    One(String),
    Many(Vec<String>),
}

impl Stop {
    fn strings(self) -> Result<Vec<String>, ApiError> {
        let stops = match self {
            Stop::One(s) => vec![s],
            Stop::Many(v) => v,
        };
        if stops.len() > MAX_STOPS || stops.iter().any(String::is_empty) {
            return Err(ApiError::bad(format!("stop: give at most {MAX_STOPS} non-empty strings"), "stop"));
        }
        Ok(stops)
    }
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: bool,
}

/// The `folio` extension object.
#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct FolioOptions {
    /// An attention method as `folio chat --method` writes it (`hip`, `magicpig:2%`, …).
    pub method: Option<String>,
}

/// Sampling arguments both endpoints take.
#[derive(Deserialize, Default)]
pub struct Sampling {
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub max_tokens: Option<u64>,
    pub seed: Option<u64>,
    pub stop: Option<Stop>,
    #[serde(default)]
    pub stream: bool,
    pub stream_options: Option<StreamOptions>,
    pub n: Option<u32>,
    pub frequency_penalty: Option<f64>,
    pub presence_penalty: Option<f64>,
    /// An end-user id: accepted, not used.
    pub user: Option<String>,
    pub folio: Option<FolioOptions>,
}

/// A chat message's content: text, or parts of which only text is read.
#[derive(Deserialize)]
#[serde(untagged)]
pub enum Content {
    Text(String),
    Parts(Vec<Part>),
}

#[derive(Deserialize)]
pub struct Part {
    #[serde(rename = "type")]
    pub kind: String,
    pub text: Option<String>,
}

#[derive(Deserialize)]
pub struct InMessage {
    pub role: String,
    pub content: Option<Content>,
    pub name: Option<String>,
}

/// The arguments of [`Sampling`], which both requests take.
const SAMPLING_ARGS: &[&str] = &[
    "temperature",
    "top_p",
    "max_tokens",
    "seed",
    "stop",
    "stream",
    "stream_options",
    "n",
    "frequency_penalty",
    "presence_penalty",
    "user",
    "folio",
];

#[derive(Deserialize)]
pub struct ChatRequest {
    pub model: String,
    pub messages: Vec<InMessage>,
    pub max_completion_tokens: Option<u64>,
    #[serde(flatten)]
    pub sampling: Sampling,
}

/// A prompt: one string, or a list of one.
#[derive(Deserialize)]
#[serde(untagged)]
pub enum Prompt {
    One(String),
    Many(Vec<String>),
}

#[derive(Deserialize)]
pub struct CompletionRequest {
    pub model: String,
    pub prompt: Prompt,
    #[serde(default)]
    pub echo: bool,
    pub suffix: Option<String>,
    pub logprobs: Option<u32>,
    pub best_of: Option<u32>,
    #[serde(flatten)]
    pub sampling: Sampling,
}

/// A conversation as the engine takes it: the system message, the turns before the question,
/// and the question.
pub struct Turns {
    pub system: Option<String>,
    pub history: Vec<Message>,
    pub question: String,
}

/// A request with its own arguments beside [`SAMPLING_ARGS`].
pub trait Request: for<'de> Deserialize<'de> {
    const ARGS: &'static [&'static str];
}

impl Request for ChatRequest {
    const ARGS: &'static [&'static str] = &["model", "messages", "max_completion_tokens"];
}

impl Request for CompletionRequest {
    const ARGS: &'static [&'static str] = &["model", "prompt", "echo", "suffix", "logprobs", "best_of"];
}

/// Parses a request body: bad JSON, an argument Folio does not know and a mistyped one are
/// refused, named (serde's words give the field and the column).
pub fn parse<T: Request>(body: &[u8]) -> Result<T, ApiError> {
    let bad = |e: serde_json::Error| ApiError::bad(format!("the request body is not valid: {e}"), "");
    let value: Value = serde_json::from_slice(body).map_err(bad)?;
    let Some(map) = value.as_object() else {
        return Err(ApiError::bad("the request body must be a JSON object", ""));
    };
    if let Some(key) = map.keys().find(|k| !T::ARGS.contains(&k.as_str()) && !SAMPLING_ARGS.contains(&k.as_str())) {
        return Err(ApiError::bad(format!("unrecognized request argument: {key}"), ""));
    }
    serde_json::from_value(value).map_err(bad)
}

impl Sampling {
    /// Refuses what Folio cannot honour: several choices, penalties, a bad range.
    pub fn check(&self) -> Result<(), ApiError> {
        if self.n.is_some_and(|n| n != 1) {
            return Err(ApiError::bad("n: Folio answers with one choice; leave n out or set it to 1", "n"));
        }
        for (name, value) in
            [("frequency_penalty", self.frequency_penalty), ("presence_penalty", self.presence_penalty)]
        {
            if value.is_some_and(|v| v != 0.0) {
                return Err(ApiError::bad(
                    format!("{name}: not supported by Folio; leave it out or set it to 0"),
                    name,
                ));
            }
        }
        if self.stream_options.is_some() && !self.stream {
            return Err(ApiError::bad("stream_options: only with \"stream\": true", "stream_options"));
        }
        if self.max_tokens == Some(0) {
            return Err(ApiError::bad("max_tokens must be at least 1", "max_tokens"));
        }
        Ok(())
    }

    pub fn include_usage(&self) -> bool {
        self.stream_options.as_ref().is_some_and(|o| o.include_usage)
    }

    /// The stop strings asked for.
    pub fn stops(&mut self) -> Result<Vec<String>, ApiError> {
        self.stop.take().map_or(Ok(Vec::new()), Stop::strings)
    }
}

impl ChatRequest {
    /// The messages as a system message, the turns before the question and the question:
    /// the last message must be the user's; only text is read; tools are refused.
    pub fn turns(&self) -> Result<Turns, ApiError> {
        let mut system: Option<String> = None;
        let mut history = Vec::new();
        for (i, m) in self.messages.iter().enumerate() {
            let text = text_of(m, i)?;
            match m.role.as_str() {
                "system" | "developer" if history.is_empty() => {
                    system = Some(match system {
                        Some(s) => format!("{s}\n\n{text}"),
                        None => text,
                    })
                }
                "system" | "developer" => {
                    return Err(ApiError::bad(
                        format!("messages[{i}]: a system message comes before the conversation's turns"),
                        "messages",
                    ))
                }
                "user" | "assistant" => history.push(Message::new(&m.role, &text)),
                other => {
                    return Err(ApiError::bad(
                        format!("messages[{i}]: role \"{other}\" is not supported (Folio has no tools): use system, user or assistant"),
                        "messages",
                    ))
                }
            }
        }
        match history.pop() {
            Some(last) if last.role == "user" => Ok(Turns { system, history, question: last.content }),
            _ => Err(ApiError::bad("messages: the last message must be the user's question", "messages")),
        }
    }
}

/// The text of message `i`: its string, or its text parts joined.
fn text_of(m: &InMessage, i: usize) -> Result<String, ApiError> {
    let _ = &m.name;
    match &m.content {
        Some(Content::Text(t)) => Ok(t.clone()),
        Some(Content::Parts(parts)) => {
            let mut text = String::new();
            for p in parts {
                match (p.kind.as_str(), &p.text) {
                    ("text", Some(t)) => text.push_str(t),
                    (kind, _) => {
                        return Err(ApiError::bad(
                            format!("messages[{i}]: a part of type \"{kind}\" is not supported: Folio reads text"),
                            "messages",
                        ))
                    }
                }
            }
            Ok(text)
        }
        None => Err(ApiError::bad(format!("messages[{i}]: no content"), "messages")),
    }
}

impl CompletionRequest {
    /// The one prompt, refusing what Folio cannot honour.
    pub fn prompt(&self) -> Result<String, ApiError> {
        if self.echo || self.suffix.is_some() || self.logprobs.is_some() || self.best_of.is_some_and(|b| b != 1) {
            return Err(ApiError::bad("echo, suffix, logprobs and best_of are not supported by Folio", ""));
        }
        match &self.prompt {
            Prompt::One(p) => Ok(p.clone()),
            Prompt::Many(v) if v.len() == 1 => Ok(v[0].clone()),
            Prompt::Many(_) => Err(ApiError::bad("prompt: give one prompt per request", "prompt")),
        }
    }
}

/// OpenAI's `finish_reason` for how an answer ended.
pub fn finish_reason(r: StopReason) -> &'static str {
    match r {
        StopReason::Eos | StopReason::StopString | StopReason::Cancelled => "stop",
        StopReason::MaxTokens | StopReason::ContextFull => "length",
    }
}

/// `usage` of a response.
pub fn usage(prompt: usize, completion: usize) -> Value {
    json!({ "prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion })
}
