-- Folio's library (docs/library.md). Context files are the source of truth for everything
-- about a context (its model, tokens, documents, K/V); the rows below describe them so the app
-- can list and search without opening files, and every one of them can be rebuilt from the
-- files (`folio library rebuild`). Chats, messages and settings live only here.

CREATE TABLE models (
    id INTEGER PRIMARY KEY,
    -- How the model is loaded: a folder or a Hugging Face repo id, as recorded in context files.
    source TEXT NOT NULL,
    name TEXT NOT NULL,
    architecture TEXT NOT NULL,
    -- context::format::Fingerprint as JSON: two models with equal fingerprints make equal K/V.
    fingerprint TEXT NOT NULL,
    UNIQUE (source, fingerprint)
);

CREATE TABLE contexts (
    id INTEGER PRIMARY KEY,
    -- Absolute path of the context file (it may not exist yet while its prefill runs).
    path TEXT NOT NULL UNIQUE,
    model_id INTEGER NOT NULL REFERENCES models (id),
    tokens INTEGER NOT NULL CHECK (tokens >= 0),
    layers INTEGER NOT NULL CHECK (layers > 0),
    layers_done INTEGER NOT NULL CHECK (layers_done >= 0 AND layers_done <= layers),
    kv_dtype TEXT NOT NULL,
    -- The file's size when ready, the size it will have while prefilling.
    file_bytes INTEGER NOT NULL CHECK (file_bytes >= 0),
    status TEXT NOT NULL CHECK (status IN ('prefilling', 'paused', 'ready', 'damaged', 'missing')),
    -- Why a context is damaged (the context file reader's message).
    problem TEXT,
    -- When the file (or the prefill's checkpoint) was last written, RFC 3339 UTC.
    saved_at TEXT NOT NULL,
    -- The file's modification time and size as last read, in nanoseconds and bytes: a list
    -- re-reads a file's header only when they change.
    seen_mtime_ns INTEGER,
    seen_bytes INTEGER
);

CREATE TABLE documents (
    id INTEGER PRIMARY KEY,
    context_id INTEGER NOT NULL REFERENCES contexts (id) ON DELETE CASCADE,
    position INTEGER NOT NULL CHECK (position >= 0),
    title TEXT NOT NULL,
    path TEXT NOT NULL,
    -- The file's type, from its extension (txt, md, rs, ...).
    kind TEXT NOT NULL,
    bytes INTEGER NOT NULL,
    -- xxh3-64 of the text: tells whether the source file changed since the prefill.
    xxh3 TEXT NOT NULL,
    token_start INTEGER NOT NULL,
    token_end INTEGER NOT NULL CHECK (token_end >= token_start),
    UNIQUE (context_id, position)
);

CREATE INDEX documents_by_context ON documents (context_id, position);

CREATE TABLE chats (
    id INTEGER PRIMARY KEY,
    -- NULL: a chat with the bare model.
    context_id INTEGER REFERENCES contexts (id) ON DELETE CASCADE,
    title TEXT NOT NULL,
    created_at TEXT NOT NULL,
    updated_at TEXT NOT NULL
);

CREATE TABLE messages (
    id INTEGER PRIMARY KEY,
    chat_id INTEGER NOT NULL REFERENCES chats (id) ON DELETE CASCADE,
    position INTEGER NOT NULL CHECK (position >= 0),
    role TEXT NOT NULL CHECK (role IN ('system', 'user', 'assistant')),
    content TEXT NOT NULL,
    -- JSON: the attention method's full settings, timings and sources of an answer.
    details TEXT,
    created_at TEXT NOT NULL,
    UNIQUE (chat_id, position)
);

CREATE TABLE settings (
    key TEXT PRIMARY KEY,
    -- JSON value.
    value TEXT NOT NULL
);
