// The library, staging and prefill jobs, settings, chats and sources: the UI side of
// src-tauri/src/gui (library_list, stage, estimate, start_prefill, resume_context, cancel_job,
// watch, ...), each command called through api.ts's one wrapper (`call`). Types mirror the
// Rust structs serialised by serde; errors reject with the backend's message as a string.

import { Channel } from '@tauri-apps/api/core';
import { call, inTauri, type AppInfo, type ChatInfo, type Comparison, type Passage } from './api';
import type { ContextInfo } from './bindings/ContextInfo';
import type { ServerStatus } from './bindings/ServerStatus';
import type { Lookup } from './bindings/Lookup';
import type { DownloadView } from './bindings/DownloadView';
import type { DownloadProgress } from './bindings/DownloadProgress';
import type { ParamSpec } from './bindings/ParamSpec';
import type { Path } from './bindings/Path';
import type { Term } from './bindings/Term';
import type { Plan } from './bindings/Plan';
import type { Status } from './bindings/Status';
import type { Phase } from './bindings/Phase';
import type { DocumentInfo } from './bindings/DocumentInfo';
import type { StagedDocument } from './bindings/StagedDocument';
import type { Skip } from './bindings/Skip';
import type { Staged } from './bindings/Staged';
import type { Estimate } from './bindings/Estimate';
import type { Progress } from './bindings/Progress';
import type { JobState } from './bindings/JobState';
import type { JobView } from './bindings/JobView';
import type { UiEvent } from './bindings/UiEvent';
import type { ChangeRequest } from './bindings/ChangeRequest';
import type { Imported } from './bindings/Imported';
import type { MethodChoice } from './bindings/MethodChoice';
import type { MethodSpec } from './bindings/MethodSpec';
import type { Choices } from './bindings/Choices';
import type { Choice } from './bindings/Choice';
import type { MeasureProgress } from './bindings/MeasureProgress';
import type { GenerationSettings } from './bindings/GenerationSettings';
import type { ChatMessage } from './bindings/ChatMessage';
import type { MethodApplied } from './bindings/MethodApplied';
import type { OpenedChat } from './bindings/OpenedChat';
import type { Piece } from './bindings/Piece';
import type { DocumentExcerpts } from './bindings/DocumentExcerpts';
import type { EngineSettings } from './bindings/EngineSettings';
import type { DeviceChoice } from './bindings/DeviceChoice';
import type { EngineView } from './bindings/EngineView';
import type { PlanView } from './bindings/PlanView';
import type { StoredIndex } from './bindings/StoredIndex';
import type { CalibrationStatus } from './bindings/CalibrationStatus';
import type { CachedModel } from './bindings/CachedModel';
import type { LibraryModel } from './bindings/LibraryModel';
import type { ModelChoices } from './bindings/ModelChoices';
import type { GgufListing } from './bindings/GgufListing';
import type { PrefillChoice } from './bindings/PrefillChoice';
import type { AnswerCost } from './bindings/AnswerCost';

// The types the Rust side sends and takes, generated from its structs (ui/src/lib/bindings,
// src-tauri/src/gui/bindings.rs): re-exported so that components import them from here.
export type { ContextInfo, DocumentInfo, StagedDocument, Skip, Staged, Estimate, Progress, JobState, JobView, UiEvent, ChangeRequest, Imported, MethodChoice, MethodSpec, GenerationSettings, OpenedChat, Piece, DocumentExcerpts, EngineSettings, DeviceChoice, EngineView, PlanView, StoredIndex, CalibrationStatus, CachedModel, LibraryModel, ModelChoices, GgufListing, ServerStatus, Lookup, DownloadView, DownloadProgress, Choices, Choice, MeasureProgress, PrefillChoice, AnswerCost };

/** A chat's message as the window reads it back (details typed; an unreadable record is null). */
export type MessageRow = ChatMessage;
/** Names the window's code uses for generated types. */
export type MethodParam = ParamSpec;
export type TierPath = Path;
export type PlanTerm = Term;
export type MemoryPlan = Plan;
export type ContextStatus = Status;
export type StagePhase = Phase;












/** Opens the window's feed (drops, drag hover, job snapshots); call once. */
export async function watch(onEvent: (e: UiEvent) => void): Promise<void> {
  if (!inTauri()) return;
  const channel = new Channel<UiEvent>(onEvent);
  await call<void>('watch', { onEvent: channel });
}

export const libraryList = () => call<ContextInfo[]>('library_list');
export const contextDocuments = (id: number) => call<DocumentInfo[]>('context_documents', { id });
export const renameContext = (id: number, name: string) => call<ContextInfo>('rename_context', { id, name });
export const removeContext = (id: number, deleteFile: boolean) =>
  call<void>('remove_context', { id, deleteFile });
export const revealContext = (id: number) => call<void>('reveal_context', { id });
export const rebuildLibrary = () => call<ContextInfo[]>('rebuild_library');
export const openContext = (id: number) => call<ContextInfo>('open_context', { id });
export const closeContext = () => call<void>('close_context');
export const estimate = (documents: StagedDocument[]) => call<Estimate>('estimate', { documents });
/** Queues a new context's prefill; `prefill` is a choice of the estimate's (`dense`, `sparse:…`). */
export const startPrefill = (documents: StagedDocument[], name: string, prefill: string | null = null) =>
  call<number>('start_prefill', { documents, name, prefill });
export const estimateChange = (id: number, change: ChangeRequest) => call<Estimate>('estimate_change', { id, change });
export const startChange = (id: number, change: ChangeRequest, prefill: string | null = null) =>
  call<number>('start_change', { id, change, prefill });
export const resumeContext = (id: number) => call<number>('resume_context', { id });
export const cancelJob = (id: number) => call<boolean>('cancel_job', { id });
export const autoResume = () => call<boolean>('auto_resume');
/** The native file picker; what is picked arrives like a drop (the feed's `dropped`). */
export const pickDocuments = (folders: boolean) => call<void>('pick_documents', { folders });
export const setAutoResume = (on: boolean) => call<void>('set_auto_resume', { on });

/** A model typed in Change model: ready to load, or a hub repo to download (its facts and size). */
export const modelLookup = (spec: string) => call<Lookup>('model_lookup', { spec });
/** Downloads a hub repo into the Hugging Face cache, reporting progress; rejects when cancelled. */
export function downloadModel(spec: string, onProgress: (p: DownloadProgress) => void): Promise<void> {
  const onEvent = new Channel<DownloadProgress>(onProgress);
  return call('download_model', { spec, onProgress: onEvent });
}
export const cancelDownload = () => call<void>('cancel_download');

/** The local API (Settings → Local API) and the log's folder. */
export const serverStatus = () => call<ServerStatus>('server_status');
export const setServer = (on: boolean, port: number) => call<ServerStatus>('set_server', { on, port });
export const revealLogs = () => call<void>('reveal_logs');

/** Verifies context files, copies them into the library's folder and lists them. */
export const importContexts = (paths: string[]) => call<Imported>('import_contexts', { paths });
/** The native picker for context files, then the import. */
export const pickImport = () => call<Imported>('pick_import');
/** The native save dialog, then the copy; null when the dialog was cancelled. */
export const exportContext = (id: number) => call<string | null>('export_context', { id });
/** Whether a dropped path is a context file (imported rather than staged). */
export const isContextFile = (path: string) => /\.folio$/i.test(path);





export const methods = () => call<MethodSpec[]>('methods');
export const currentMethod = () => call<MethodChoice>('method');
/** Checked like the CLI's --method; refused, the method stays what it was. */
export const setMethod = (choice: MethodChoice) => call<MethodApplied>('set_method', { choice });


export const currentGeneration = () => call<GenerationSettings>('generation');
/** Checked as the decode loop checks them; refused, they stay what they were. */
export const setGeneration = (settings: GenerationSettings) => call<GenerationSettings>('set_generation', { settings });

export type { ChatInfo } from './api';



export const listChats = (search: string | null) => call<ChatInfo[]>('list_chats', { search });
export const openChat = (id: number) => call<OpenedChat>('open_chat', { id });
/** The chat the window showed last, if the library still has it (a restart opens it). */
export const lastChat = () => call<number | null>('last_chat');
export const renameChat = (id: number, title: string) => call<ChatInfo>('rename_chat', { id, title });
export const deleteChat = (id: number) => call<void>('delete_chat', { id });
/** A new chat with the first `keep` messages (whole turns), opened. */
export const forkChat = (id: number, keep: number) => call<OpenedChat>('fork_chat', { id, keep });
/** Drops the chat's last answer and its question; returns the question to ask again. */
export const regenerate = (id: number) => call<string>('regenerate', { id });



/** The text of a source of an answer over the open context; refused when the context has
 *  changed since the answer (`context` is the version it read). */
export const sourceExcerpts = (document: number, passages: Passage[], context: string | null) =>
  call<DocumentExcerpts>('source_excerpts', { document, passages, context });

/** Compares answer `position` of the chat on screen with dense attention (saved with it);
 *  `onProgress(done, total)` follows its steps; Stop (cancelChat) stops it. */
export async function compareDense(
  position: number,
  onProgress: (done: number, total: number) => void,
): Promise<Comparison> {
  const onEvent = new Channel<{ done: number; total: number }>((p) => onProgress(p.done, p.total));
  return call('compare_dense', { position, onEvent });
}




export const engineSettings = () => call<EngineView>('engine_settings');
/** Checked and applied at once; a device change loads the model again (info: the new app
 *  state). Refused, nothing changes. */
export const setEngineSettings = (settings: EngineSettings) =>
  call<{ engine: EngineView; info: AppInfo | null }>('set_engine_settings', { settings });




/** The planner for the open context with `method` (null: the chat's). */
export const memoryPlan = (method: MethodChoice | null) => call<PlanView>('memory_plan', { method });

/** The context the chat is over, and its default method (what new chats over it start with). */
export const openContextMethod = () =>
  call<{ context: number | null; method: MethodChoice | null }>('open_context_method');
/** Makes the method in use the open context's default. */
export const setContextMethod = () => call<MethodChoice>('set_context_method');


/** Builds the index of the method in use into the open context's file; `onProgress(layer,
 *  layers)` follows it; Stop (cancelChat) stops it with the file unchanged. */
export async function buildIndex(onProgress: (layer: number, layers: number) => void): Promise<StoredIndex> {
  const onEvent = new Channel<{ layer: number; layers: number }>((p) => onProgress(p.layer, p.layers));
  return call('build_index', { onEvent });
}


export const calibration = () => call<CalibrationStatus>('calibration');

/** Each method's measured speed over the open context and answer quality, and the one recommended. */
export const methodChoices = () => call<Choices>('method_choices');

/** Times a short answer of each method not yet measured over the open context (Stop stops it). */
export async function measureMethods(onProgress: (p: MeasureProgress) => void): Promise<Choices> {
  const onEvent = new Channel<MeasureProgress>(onProgress);
  return call('measure_methods', { onEvent });
}

/** Calibrates the running model on the open context's documents (kept in Folio's home). */
export async function calibrate(onProgress: (done: number, total: number) => void): Promise<CalibrationStatus> {
  const onEvent = new Channel<{ done: number; total: number }>((p) => onProgress(p.done, p.total));
  return call('calibrate', { onEvent });
}




export const modelChoices = () => call<ModelChoices>('models');
/** Loads a model folder or Hugging Face repo id; the window runs it from the next question on. */
export const loadModel = (spec: string) => call<AppInfo>('load_model', { spec });
/** The native folder dialog, then the load; null when cancelled. */
export const pickModelFolder = () => call<AppInfo | null>('pick_model_folder');
/** The native file dialog for a .gguf file, then the load; null when cancelled. */
export const pickModelFile = () => call<AppInfo | null>('pick_model_file');
/** Whether a dropped path is a GGUF model (loaded rather than staged as a document). */
export const isModelFile = (path: string) => /\.gguf$/i.test(path);
/** A drop sorted: a GGUF model to run (the first), context files to import, documents to stage. */
export const sortDrop = (paths: string[]) => ({
  model: paths.find(isModelFile),
  files: paths.filter(isContextFile),
  documents: paths.filter((p) => !isContextFile(p) && !isModelFile(p)),
});


/** Reads and counts files and folders; `onProgress(phase, done, total)` follows the reads, then
 *  the count. */
export function stage(
  paths: string[],
  onProgress: (phase: StagePhase, done: number, total: number) => void,
): Promise<Staged> {
  const channel = new Channel<{ phase: StagePhase; done: number; total: number }>((p) =>
    onProgress(p.phase, p.done, p.total),
  );
  return call<Staged>('stage', { paths, onProgress: channel });
}

/** 1536 → "1.5 KiB". */
export function bytes(n: number): string {
  const units = ['B', 'KiB', 'MiB', 'GiB', 'TiB'];
  let v = n;
  let u = 0;
  while (v >= 1024 && u < units.length - 1) {
    v /= 1024;
    u++;
  }
  return `${v.toFixed(u === 0 ? 0 : 1)} ${units[u]}`;
}

/** 12345 → "12,345". */
export const count = (n: number): string => n.toLocaleString('en-US');
/** `n` things, in the singular for one ("1 document", "3 documents"). */
export const plural = (n: number, one: string, many = `${one}s`): string => `${count(n)} ${n === 1 ? one : many}`;

/** The name a new context takes from what was dropped or picked: a folder's name, a file's
 *  without its extension ("notes.md" → "notes"; hidden names lose their dots), and several
 *  files at once "notes and 2 more" — never the first alone, which would misname the rest. */
export function contextName(paths: string[]): string {
  const first = (paths[0] ?? '').replace(/\/+$/, '');
  const base = (first.split('/').pop() ?? '').replace(/(.)\.[^.]+$/, '$1').replace(/^\.+/, '') || 'Documents';
  const file = /[^/]\.[^./]+$/.test(first);
  return file && paths.length > 1 ? `${base} and ${paths.length - 1} more` : base;
}

/** When a chat was last answered, as a person reads a list: "14:32" today, else "3 May"
 *  (with the year when it is another). `at` is RFC 3339, as the library writes it. */
export function when(at: string, now: Date = new Date()): string {
  const t = new Date(at);
  if (Number.isNaN(t.getTime())) return '';
  if (t.toDateString() === now.toDateString()) {
    return t.toLocaleTimeString('en-GB', { hour: '2-digit', minute: '2-digit' });
  }
  const year = t.getFullYear() === now.getFullYear() ? undefined : 'numeric';
  return t.toLocaleDateString('en-GB', { day: 'numeric', month: 'short', year });
}

/** 75 → "1m 15s". */
export function duration(s: number): string {
  if (s < 1) return 'under a second';
  const t = Math.round(s);
  if (t < 60) return `${t}s`;
  if (t < 3600) return `${Math.floor(t / 60)}m ${String(t % 60).padStart(2, '0')}s`;
  return `${Math.floor(t / 3600)}h ${String(Math.floor((t % 3600) / 60)).padStart(2, '0')}m`;
}

/** A prefill choice's name: "Dense", or "Sparse (block-sparse, as MInference)". */
export function prefillLabel(c: PrefillChoice): string {
  return c.keys_per_row === null ? 'Dense' : 'Sparse (block-sparse, as MInference)';
}

/** 131072 → "128k", 1048576 → "1M", 5000 → "5,000": a context length as the docs write it. */
export function lengthLabel(tokens: number): string {
  if (tokens >= 1 << 20 && tokens % (1 << 20) === 0) return `${tokens >> 20}M`;
  if (tokens >= 1 << 10 && tokens % (1 << 10) === 0) return `${tokens >> 10}k`;
  return count(tokens);
}

/** One measured cost in answers: "at 128k, 9 of 9 answers right (over a dense prefill 9), KL 0.0008". */
export function answerCost(a: AnswerCost): string {
  return (
    `at ${lengthLabel(a.length)}, ${a.answered} of ${a.prompts} answers right ` +
    `(over a dense prefill ${a.dense_answered}), KL ${a.mean_kl.toFixed(4)}`
  );
}
