//! Chats and their messages: the one thing the library keeps that no file describes.
//!
//! A chat is over one context (or the bare model: `context_id` NULL) and holds its messages in
//! order — user and assistant turns, each answer with the details of how it was made (method
//! settings, timings, sources) as JSON. The K/V of a chat's turns is never stored: the engine's
//! session rebuilds it from the messages on the saved context, so a chat reopened after a
//! restart needs no prefill of the documents. A chat's own settings (the attention method and
//! generation settings its next answer uses) are JSON too, owned by the window.
//!
//! Forking copies the first messages into a new chat; regenerating drops the last answer. Both
//! keep whole turns, as the engine's `Conversation::fork` does.

use serde::Serialize;
use sqlx::Row;

use crate::{Error, Library, Result};

/// A chat as the window lists it.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[cfg_attr(feature = "ts", derive(ts_rs::TS))]
pub struct ChatInfo {
    pub id: i64,
    /// The context it is over; `None` for the bare model.
    pub context_id: Option<i64>,
    /// That context's name (its file's stem), for the list.
    pub context_name: Option<String>,
    pub title: String,
    pub created_at: String,
    pub updated_at: String,
    pub messages: u64,
    /// The chat's settings (JSON, the window's): what its next answer uses.
    pub settings: Option<serde_json::Value>,
}

/// One message of a chat.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct MessageRow {
    pub position: u64,
    /// "user" or "assistant".
    pub role: String,
    pub content: String,
    /// How an answer was made (method, settings, timings, sources), as the window recorded it.
    pub details: Option<serde_json::Value>,
    pub created_at: String,
}

/// A message to append.
pub struct NewMessage<'a> {
    pub role: &'a str,
    pub content: &'a str,
    pub details: Option<&'a serde_json::Value>,
}

/// Longest chat title kept (a first question can be long).
const MAX_TITLE_CHARS: usize = 120;

fn now() -> String {
    chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Millis, true)
}

fn title_of(text: &str) -> Result<String> {
    let line = text.lines().map(str::trim).find(|l| !l.is_empty()).unwrap_or_default();
    if line.is_empty() {
        return Err(Error::Refused("a chat's title cannot be empty".into()));
    }
    Ok(match line.char_indices().nth(MAX_TITLE_CHARS) {
        Some((at, _)) => format!("{}…", &line[..at]),
        None => line.to_owned(),
    })
}

fn chat_not_found(id: i64) -> Error {
    Error::NotFound(format!("no chat {id} in the library: it was deleted"))
}

const CHAT_COLUMNS: &str = "h.id, h.context_id, h.title, h.created_at, h.updated_at, h.settings, c.path, \
     (SELECT COUNT(*) FROM messages m WHERE m.chat_id = h.id) AS messages";

fn chat_row(r: &sqlx::sqlite::SqliteRow) -> ChatInfo {
    let path: Option<String> = r.get("path");
    let settings: Option<String> = r.get("settings");
    ChatInfo {
        id: r.get("id"),
        context_id: r.get("context_id"),
        context_name: path.map(|p| {
            std::path::Path::new(&p).file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default()
        }),
        title: r.get("title"),
        created_at: r.get("created_at"),
        updated_at: r.get("updated_at"),
        messages: r.get::<i64, _>("messages").max(0) as u64,
        settings: settings.and_then(|s| serde_json::from_str(&s).ok()),
    }
}

impl Library {
    /// A new, empty chat over context `context_id` (or the bare model), titled by `title`'s
    /// first line.
    pub async fn create_chat(&self, context_id: Option<i64>, title: &str) -> Result<ChatInfo> {
        let title = title_of(title)?;
        let at = now();
        let id: i64 = sqlx::query_scalar(
            "INSERT INTO chats (context_id, title, created_at, updated_at) VALUES (?, ?, ?, ?) RETURNING id",
        )
        .bind(context_id)
        .bind(&title)
        .bind(&at)
        .bind(&at)
        .fetch_one(&self.pool)
        .await
        .map_err(|e| match &e {
            sqlx::Error::Database(d) if d.is_foreign_key_violation() => {
                Error::NotFound(format!("no context {} in the library: it was removed", context_id.unwrap_or_default()))
            }
            _ => self.err(e),
        })?;
        self.chat(id).await
    }

    pub async fn chat(&self, id: i64) -> Result<ChatInfo> {
        let sql =
            format!("SELECT {CHAT_COLUMNS} FROM chats h LEFT JOIN contexts c ON c.id = h.context_id WHERE h.id = ?");
        let row = sqlx::query(&sql).bind(id).fetch_optional(&self.pool).await.map_err(|e| self.err(e))?;
        row.as_ref().map(chat_row).ok_or_else(|| chat_not_found(id))
    }

    /// Chats, most recently updated first; with `search`, those whose title or messages
    /// contain it (case-insensitive for ASCII).
    pub async fn chats(&self, search: Option<&str>) -> Result<Vec<ChatInfo>> {
        let filter = match search.map(str::trim).filter(|s| !s.is_empty()) {
            Some(_) => {
                "WHERE h.title LIKE ?1 ESCAPE '\\' OR EXISTS (SELECT 1 FROM messages m WHERE m.chat_id = h.id \
                 AND m.content LIKE ?1 ESCAPE '\\')"
            }
            None => "",
        };
        let sql = format!(
            "SELECT {CHAT_COLUMNS} FROM chats h LEFT JOIN contexts c ON c.id = h.context_id {filter} \
             ORDER BY h.updated_at DESC, h.id DESC"
        );
        let mut query = sqlx::query(&sql);
        if let Some(s) = search.map(str::trim).filter(|s| !s.is_empty()) {
            let escaped = s.replace('\\', "\\\\").replace('%', "\\%").replace('_', "\\_");
            query = query.bind(format!("%{escaped}%"));
        }
        let rows = query.fetch_all(&self.pool).await.map_err(|e| self.err(e))?;
        Ok(rows.iter().map(chat_row).collect())
    }

    /// A chat's messages, in order.
    pub async fn messages(&self, chat: i64) -> Result<Vec<MessageRow>> {
        self.chat(chat).await?;
        let rows = sqlx::query(
            "SELECT position, role, content, details, created_at FROM messages WHERE chat_id = ? ORDER BY position",
        )
        .bind(chat)
        .fetch_all(&self.pool)
        .await
        .map_err(|e| self.err(e))?;
        Ok(rows
            .iter()
            .map(|r| {
                let details: Option<String> = r.get("details");
                MessageRow {
                    position: r.get::<i64, _>("position").max(0) as u64,
                    role: r.get("role"),
                    content: r.get("content"),
                    details: details.and_then(|d| serde_json::from_str(&d).ok()),
                    created_at: r.get("created_at"),
                }
            })
            .collect())
    }

    /// Appends messages to a chat in one transaction (a question and its answer land together
    /// or not at all).
    pub async fn append_messages(&self, chat: i64, messages: &[NewMessage<'_>]) -> Result<ChatInfo> {
        let mut tx = self.write().await?;
        let next: Option<i64> = sqlx::query_scalar(
            "SELECT (SELECT COALESCE(MAX(position) + 1, 0) FROM messages WHERE chat_id = ?1) FROM chats WHERE id = ?1",
        )
        .bind(chat)
        .fetch_optional(&mut *tx)
        .await
        .map_err(|e| self.err(e))?;
        let next = next.ok_or_else(|| chat_not_found(chat))?;
        let at = now();
        for (i, m) in messages.iter().enumerate() {
            if !matches!(m.role, "user" | "assistant") {
                return Err(Error::Refused(format!(
                    "a chat message is from the user or the assistant, not {:?}",
                    m.role
                )));
            }
            sqlx::query(
                "INSERT INTO messages (chat_id, position, role, content, details, created_at) VALUES (?, ?, ?, ?, ?, ?)",
            )
            .bind(chat)
            .bind(next + i as i64)
            .bind(m.role)
            .bind(m.content)
            .bind(m.details.map(|d| d.to_string()))
            .bind(&at)
            .execute(&mut *tx)
            .await
            .map_err(|e| self.err(e))?;
        }
        sqlx::query("UPDATE chats SET updated_at = ? WHERE id = ?")
            .bind(&at)
            .bind(chat)
            .execute(&mut *tx)
            .await
            .map_err(|e| self.err(e))?;
        tx.commit().await.map_err(|e| self.err(e))?;
        self.chat(chat).await
    }

    /// Keeps a chat's first `keep` messages (whole turns: an even count), dropping the rest:
    /// what regenerating the last answer starts from.
    pub async fn truncate_chat(&self, chat: i64, keep: u64) -> Result<ChatInfo> {
        check_whole_turns(keep)?;
        self.chat(chat).await?;
        sqlx::query("DELETE FROM messages WHERE chat_id = ? AND position >= ?")
            .bind(chat)
            .bind(keep as i64)
            .execute(&self.pool)
            .await
            .map_err(|e| self.err(e))?;
        self.chat(chat).await
    }

    /// A new chat over the same context with the first `keep` messages of `chat` (whole turns)
    /// and its settings: to ask something else from there.
    pub async fn fork_chat(&self, chat: i64, keep: u64) -> Result<ChatInfo> {
        check_whole_turns(keep)?;
        let from = self.chat(chat).await?;
        if keep > from.messages {
            return Err(Error::Refused(format!("chat {chat} has {} messages, not {keep}", from.messages)));
        }
        let mut tx = self.write().await?;
        let at = now();
        let id: i64 = sqlx::query_scalar(
            "INSERT INTO chats (context_id, title, created_at, updated_at, settings) \
             SELECT context_id, title || ' (fork)', ?, ?, settings FROM chats WHERE id = ? RETURNING id",
        )
        .bind(&at)
        .bind(&at)
        .bind(chat)
        .fetch_one(&mut *tx)
        .await
        .map_err(|e| self.err(e))?;
        sqlx::query(
            "INSERT INTO messages (chat_id, position, role, content, details, created_at) \
             SELECT ?, position, role, content, details, created_at FROM messages WHERE chat_id = ? AND position < ?",
        )
        .bind(id)
        .bind(chat)
        .bind(keep as i64)
        .execute(&mut *tx)
        .await
        .map_err(|e| self.err(e))?;
        tx.commit().await.map_err(|e| self.err(e))?;
        self.chat(id).await
    }

    pub async fn rename_chat(&self, chat: i64, title: &str) -> Result<ChatInfo> {
        let title = title_of(title)?;
        self.change_chat(chat, sqlx::query("UPDATE chats SET title = ? WHERE id = ?").bind(title)).await?;
        self.chat(chat).await
    }

    /// Stores a chat's settings (what its next answer uses).
    pub async fn set_chat_settings(&self, chat: i64, settings: &serde_json::Value) -> Result<()> {
        self.change_chat(chat, sqlx::query("UPDATE chats SET settings = ? WHERE id = ?").bind(settings.to_string()))
            .await
    }

    /// Replaces the details of message `position` of `chat` (an answer's, with what was
    /// learnt of it since: a comparison with dense attention); a message that is not there is
    /// an error.
    pub async fn set_message_details(&self, chat: i64, position: u64, details: &serde_json::Value) -> Result<()> {
        self.chat(chat).await?;
        let done = sqlx::query("UPDATE messages SET details = ? WHERE chat_id = ? AND position = ?")
            .bind(details.to_string())
            .bind(chat)
            .bind(position as i64)
            .execute(&self.pool)
            .await
            .map_err(|e| self.err(e))?;
        if done.rows_affected() == 0 {
            return Err(Error::Refused(format!("chat {chat} has no message {position}")));
        }
        Ok(())
    }

    /// Deletes a chat and its messages.
    pub async fn delete_chat(&self, chat: i64) -> Result<()> {
        self.change_chat(chat, sqlx::query("DELETE FROM chats WHERE id = ?")).await
    }

    /// Runs `query` with `chat` bound last (its `WHERE id = ?`); a chat that is not there is
    /// an error, not a silent no-op.
    async fn change_chat<'q>(
        &self,
        chat: i64,
        query: sqlx::query::Query<'q, sqlx::Sqlite, sqlx::sqlite::SqliteArguments<'q>>,
    ) -> Result<()> {
        let done = query.bind(chat).execute(&self.pool).await.map_err(|e| self.err(e))?;
        if done.rows_affected() == 0 {
            return Err(chat_not_found(chat));
        }
        Ok(())
    }
}

fn check_whole_turns(keep: u64) -> Result<()> {
    if keep % 2 == 1 {
        return Err(Error::Refused(format!(
            "a chat keeps whole turns (a question and its answer): {keep} messages is half a turn"
        )));
    }
    Ok(())
}
