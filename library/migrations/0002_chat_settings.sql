-- A chat's own settings (JSON, written by the window): the attention method, budget and knobs,
-- and the generation settings its next answer uses. NULL: the defaults.
ALTER TABLE chats ADD COLUMN settings TEXT;
