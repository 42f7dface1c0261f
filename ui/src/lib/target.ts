// Where the composer's question goes, and how a saved chat's messages come back: plain functions
// of the window's state, kept out of App.svelte so that the rule "a question goes where the
// person is looking" is written once and read in one place.

import type { ChatInfo, ContextInfo, OpenedChat } from './library';
import type { Message } from './types';

/** The composer's target: the context it asks over (its name, for the placeholder) and the line
 *  shown above the box. `panel` is the context whose panel is on screen, `open` the one the
 *  chat on screen is over. */
export function composerTarget(
  panel: ContextInfo | null,
  open: ContextInfo | null,
  chatId: number | null,
  chats: ChatInfo[],
  refused: boolean,
): { name: string | null; line: string } {
  if (refused && !panel) return { name: null, line: 'This chat cannot be continued here — New chat (Ctrl+N) to ask' };
  const over = panel ?? open;
  // The chat on screen, by title when the (searched) list has it.
  const inChat = chatId !== null && !panel;
  const title = inChat ? chats.find((c) => c.id === chatId)?.title : null;
  const where = inChat ? (title ? `in “${title}”` : 'in this chat') : 'new chat';
  if (!over) return { name: null, line: `Asks the model alone — no documents · ${where}` };
  return { name: over.name, line: `Asks ${over.name} · ${where}` };
}

/** A saved chat's messages as the message list shows them, numbered from `firstId`. */
export function savedMessages(opened: OpenedChat, firstId: number): Message[] {
  return opened.messages.map((m, i) => ({
    id: firstId + i,
    role: m.role,
    text: m.content,
    status: 'done' as const,
    details: m.details ?? undefined,
    saved: true,
    stats: m.details
      ? {
          stop_reason: m.details.stop_reason,
          tokens: m.details.tokens,
          tokens_per_second: m.details.timings.decode_tokens_per_s ?? 0,
        }
      : undefined,
  }));
}

/** The title a chat on screen will be saved under: its first question's first line, shortened
 *  (`null` before a question). */
export function draftTitle(messages: Message[]): string | null {
  const first = messages.find((m) => m.role === 'user');
  if (!first) return null;
  const line = first.text.split('\n', 1)[0] ?? '';
  return line.length > 60 ? `${line.slice(0, 60)}…` : line;
}
