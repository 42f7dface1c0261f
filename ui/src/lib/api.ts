// The single place the UI talks to the Rust side of Folio: `call` is the one wrapper of
// Tauri's `invoke` (library.ts's commands go through it too), and the chat's own calls are here.
//
//   app_info()                      -> AppInfo
//   chat({ prompt, onEvent })       -> ChatResult     (rejects with a string message)
//       onEvent: Channel<ChatEvent>, messages tagged { event, data }
//   cancel_chat(), new_chat()       -> ()
//
// Tauri maps the JS argument `onEvent` to the Rust parameter `on_event`.
//
// Outside the Folio app (plain browser, `npm run dev` without Tauri) nothing
// here throws at import time: app_info answers with a "not in the app" stub,
// every other call rejects with a readable message and cancel_chat is a no-op.

import { Channel, invoke } from '@tauri-apps/api/core';
import type { AppInfo } from './bindings/AppInfo';
import type { ChatDone } from './bindings/ChatDone';
import type { ModelFacts } from './bindings/ModelFacts';
import type { ChatEvent } from './bindings/ChatEvent';
import type { ChatInfo } from './bindings/ChatInfo';

// The types the Rust side sends and takes, generated from its structs (ui/src/lib/bindings,
// src-tauri/src/gui/bindings.rs): re-exported so that components import them from here.
export type { AppInfo, ModelFacts, ChatEvent, ChatInfo };




/** A stretch of a document the attention read: context positions start..end. */
export interface Passage {
  start: number;
  end: number;
  /** Of the document's weight. */
  share: number;
  /** The page, chapter or section it is in ("p. 12"), when the document has parts. */
  part?: string | null;
}

/** How an answer was made, as the library keeps it with the answer. The Rust side builds it as
 *  JSON (src-tauri/src/gui/chats.rs, `answer_details`), so it is typed here by hand, with
 *  `Passage` and `Comparison`, until it is a Rust struct the bindings can follow. */
export interface AnswerDetails {
  method: { method: string; budget?: string | null; params?: unknown };
  settings: { method: string; budget?: unknown; params?: Record<string, unknown> };
  stop_reason: string;
  tokens: number;
  timings: { first_token_s: number | null; seconds: number; decode_tokens_per_s: number | null };
  sources: {
    document: number;
    title: string;
    path: string;
    rows: number;
    share: number;
    /** Of the attention mass of every row read; null when it was not weighed. */
    mass_share: number | null;
    /** Where in the document, heaviest first (context positions). */
    passages?: Passage[];
  }[];
  /** Where each layer's index came from (methods with one): read from the file, or built. */
  index?: Record<string, 'file' | 'built' | 'rebuilt'>;
  /** The id of the context version the answer read (its sources' positions refer to it). */
  context?: string | null;
  reused_tokens: number;
  /** The answer's token ids (what a comparison with dense replays). */
  answer_tokens?: number[];
  /** Its comparison with dense attention, once made. */
  comparison?: Comparison;
}

/** An answer next to dense attention's on the same context and turn. */
export interface Comparison {
  steps: number;
  /** KL(dense ‖ method) of the next-token distributions along the answer, nats. */
  mean_kl: number;
  max_kl: number;
  max_kl_step: number;
  top1_agreement: number;
  first_disagreement: number | null;
  dense_answer: string;
  same_answer: boolean;
  seconds: number;
}

/** What `chat` resolves with: the generated `ChatDone`, its details typed (below). */
export type ChatResult = Omit<ChatDone, 'details'> & { details: AnswerDetails };


export type DoneInfo = Extract<ChatEvent, { event: 'done' }>['data'];

export interface ChatHandlers {
  onToken: (text: string) => void;
  onDone?: (info: DoneInfo) => void;
}

declare global {
  interface Window {
    __TAURI_INTERNALS__?: unknown;
  }
}

/** True when running inside the Tauri webview (the real app). */
export function inTauri(): boolean {
  return typeof window !== 'undefined' && window.__TAURI_INTERNALS__ !== undefined;
}

const NOT_IN_APP = 'Not running inside the Folio app';

/** Turn whatever a rejected invoke carries into a human-readable string. */
export function errorMessage(err: unknown): string {
  if (typeof err === 'string') return err;
  if (err instanceof Error) return err.message;
  if (err && typeof err === 'object' && 'message' in err) {
    const m = (err as { message: unknown }).message;
    if (typeof m === 'string') return m;
  }
  try {
    return JSON.stringify(err);
  } catch {
    return String(err);
  }
}

export async function appInfo(): Promise<AppInfo> {
  if (!inTauri()) {
    return {
      version: 'dev',
      model: null,
      device: 'browser',
      model_error: NOT_IN_APP,
      library: null,
      library_error: null,
      model_facts: null,
      startup_notice: null,
    };
  }
  return call<AppInfo>('app_info');
}

/**
 * Ask the model. Tokens are delivered through `handlers.onToken` as they are
 * generated; the promise resolves when generation ends (finished, hit a limit
 * or cancelled) and rejects with the backend's error message as a string.
 */
export async function chat(prompt: string, handlers: ChatHandlers): Promise<ChatResult> {
  if (!inTauri()) {
    throw NOT_IN_APP;
  }
  const onEvent = new Channel<ChatEvent>((msg) => {
    switch (msg.event) {
      case 'token':
        handlers.onToken(msg.data.text);
        break;
      case 'done':
        handlers.onDone?.(msg.data);
        break;
    }
  });
  return call<ChatResult>('chat', { prompt, onEvent });
}

/**
 * The one wrapper of Tauri's `invoke`: every command of the backend is called through it.
 * Outside the app it rejects with a readable message; a rejection carries the backend's
 * message as a string (the CLI's wording).
 */
export async function call<T>(name: string, args?: Record<string, unknown>): Promise<T> {
  if (!inTauri()) throw NOT_IN_APP;
  try {
    return await invoke<T>(name, args);
  } catch (err) {
    throw errorMessage(err);
  }
}

/** A command that takes nothing and returns nothing; a no-op outside the app. */
async function command(name: string): Promise<void> {
  if (!inTauri()) return;
  await call<void>(name);
}

/** Ask the backend to stop the running generation; `chat` then resolves. */
export const cancelChat = (): Promise<void> => command('cancel_chat');

/** A new chat over the open context (the backend's: it answers which, null for the model alone). */
export const newChat = async (): Promise<number | null> => (inTauri() ? call<number | null>('new_chat') : null);
