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
import type { AnswerDetails } from './bindings/AnswerDetails';
import type { Comparison } from './bindings/Comparison';
import type { Passage } from './bindings/Passage';

// The types the Rust side sends and takes, generated from its structs (ui/src/lib/bindings,
// src-tauri/src/gui/bindings.rs): re-exported so that components import them from here.
export type { AppInfo, ModelFacts, ChatEvent, ChatInfo, AnswerDetails, Comparison, Passage };




/** What `chat` resolves with. */
export type ChatResult = ChatDone;

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
