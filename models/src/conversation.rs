//! A conversation: the turns asked and answered so far, over one saved context (or the bare
//! model), and its small JSON file.
//!
//! A conversation is data, not state: the K/V of its turns lives in a [`crate::session::Session`],
//! which rebuilds what it lacks from the messages (a reopened conversation, a fork) and reuses
//! what it holds (a follow-up). So a fork is a prefix of the messages, and any conversation can
//! continue in any session over the same context. Which context is checked by the checksum of
//! its token ids, not its path: a moved file still matches, another file with the same name
//! does not.
//!
//! File format (`folio-chat`, version 1): `{format, version, context_id, context, messages}`,
//! written atomically; a bare-model conversation has no `context_id`/`context` and may carry
//! a `system` message.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::chat::Message;
use crate::context::ContextFile;
use crate::error::{Error, Result};

const FORMAT: &str = "folio-chat";
/// The largest conversation file read: far beyond any chat (a million tokens of turns is a few
/// MiB), far below what would exhaust memory.
const MAX_CONVERSATION_BYTES: u64 = 64 << 20;
const VERSION: u32 = 1;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Conversation {
    format: String,
    version: u32,
    /// Checksum of the context's token ids: a conversation continues only on its own context.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub context_id: Option<String>,
    /// Where the context file was when the conversation began (for messages; the context is
    /// matched by `context_id`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub context: Option<PathBuf>,
    /// A bare-model conversation's system message (a context's is fixed at prefill).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub system: Option<String>,
    /// User and assistant turns, alternating, starting with the user.
    pub messages: Vec<Message>,
}

impl Conversation {
    /// An empty conversation over `file`.
    pub fn over(file: &ContextFile) -> Self {
        Self {
            format: FORMAT.into(),
            version: VERSION,
            context_id: Some(file.context_id().to_owned()),
            context: Some(file.path().to_owned()),
            system: None,
            messages: Vec::new(),
        }
    }

    /// An empty conversation with the bare model.
    pub fn bare(system: Option<String>) -> Self {
        Self { format: FORMAT.into(), version: VERSION, context_id: None, context: None, system, messages: Vec::new() }
    }

    /// Reads a conversation file.
    pub fn load(path: &Path) -> Result<Self> {
        let bytes = folio_context_file::atomic::read_input(path, "a conversation file", MAX_CONVERSATION_BYTES)?;
        let text = String::from_utf8(bytes).map_err(|_| {
            Error::Invalid(format!("{} is not a Folio conversation file: not UTF-8 text", path.display()))
        })?;
        let conv: Self = serde_json::from_str(&text)
            .map_err(|e| Error::Invalid(format!("{} is not a Folio conversation file: {e}", path.display())))?;
        if conv.format != FORMAT || conv.version != VERSION {
            return Err(Error::Invalid(format!(
                "{} is not a Folio conversation file (format {} v{}; this Folio reads {FORMAT} v{VERSION})",
                path.display(),
                conv.format,
                conv.version
            )));
        }
        Ok(conv)
    }

    /// The conversation in `path` over `file`, or an empty one when `path` does not exist;
    /// refused when it continues another context.
    pub fn load_or_new(path: &Path, file: &ContextFile) -> Result<Self> {
        if !path.exists() {
            return Ok(Self::over(file));
        }
        let conv = Self::load(path)?;
        conv.check_context(Some(file)).map_err(|_| {
            Error::Invalid(format!(
                "{} continues the conversation over {}, not over {}; use a new conversation file",
                path.display(),
                conv.context.as_deref().map_or("the bare model".into(), |p| p.display().to_string()),
                file.path().display()
            ))
        })?;
        Ok(conv)
    }

    /// Refuses this conversation over another context than `file` (or over one when it was
    /// with the bare model, and the reverse).
    pub fn check_context(&self, file: Option<&ContextFile>) -> Result<()> {
        match (&self.context_id, file) {
            (None, None) => Ok(()),
            (Some(id), Some(f)) if id == f.context_id() => Ok(()),
            (_, Some(f)) => Err(Error::Invalid(format!(
                "this conversation is not over {} (its documents differ); start a new one",
                f.path().display()
            ))),
            (Some(_), None) => Err(Error::Invalid(
                "this conversation is over a saved context; open that context to continue it".into(),
            )),
        }
    }

    /// Atomic: a crash while saving keeps the previous file.
    pub fn save(&self, path: &Path) -> Result<()> {
        let bytes = serde_json::to_vec_pretty(self).map_err(|e| Error::Invalid(e.to_string()))?;
        Ok(crate::context::write_atomic(path, &bytes)?)
    }

    /// A new conversation with the first `messages` of this one: a fork after an answer (to ask
    /// something else from there, or the same question differently). The count is even — whole
    /// turns — so the next question follows an answer, as chat templates require.
    pub fn fork(&self, messages: usize) -> Result<Self> {
        if messages > self.messages.len() || messages % 2 == 1 {
            return Err(Error::Invalid(format!(
                "cannot fork at message {messages}: a fork keeps whole turns (an even count up to {})",
                self.messages.len()
            )));
        }
        Ok(Self { messages: self.messages[..messages].to_vec(), ..self.clone() })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_and_forks() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("chat.json");
        let mut conv = Conversation::bare(Some("be brief".into()));
        conv.messages.push(Message::new("user", "hi"));
        conv.messages.push(Message::new("assistant", "hello"));
        conv.save(&path).unwrap();
        let back = Conversation::load(&path).unwrap();
        assert_eq!(back, conv);
        assert!(back.check_context(None).is_ok());
        assert_eq!(back.fork(2).unwrap().messages, back.messages);
        assert!(back.fork(0).unwrap().messages.is_empty());
        assert!(back.fork(1).unwrap_err().to_string().contains("whole turns"));
        assert!(back.fork(4).unwrap_err().to_string().contains("up to 2"));
        std::fs::write(&path, br#"{"format": "other", "version": 1, "messages": []}"#).unwrap();
        assert!(Conversation::load(&path).unwrap_err().to_string().contains("not a Folio conversation file"));
    }
}
