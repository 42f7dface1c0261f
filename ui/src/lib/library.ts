// The library, staging and prefill jobs, settings, chats and sources: the UI side of
// src-tauri/src/gui (library_list, stage, estimate, start_prefill, resume_context, cancel_job,
// watch, ...), each command called through api.ts's one wrapper (`call`). Types mirror the
// Rust structs serialised by serde; errors reject with the backend's message as a string.

import { Channel } from '@tauri-apps/api/core';
import { call, inTauri, type AnswerDetails, type AppInfo, type ChatInfo, type Comparison, type Passage } from './api';

export type ContextStatus = 'prefilling' | 'paused' | 'ready' | 'damaged' | 'missing';

export interface ContextInfo {
  id: number;
  name: string;
  path: string;
  model: { name: string; source: string; architecture: string; fingerprint: string };
  tokens: number;
  layers: number;
  layers_done: number;
  kv_dtype: string;
  file_bytes: number;
  status: ContextStatus;
  problem: string | null;
  saved_at: string;
  documents: number;
  /** A change (documents added or one taken out) was interrupted; the file is as before it. */
  change_pending: boolean;
}

export interface DocumentInfo {
  title: string;
  path: string;
  kind: string;
  bytes: number;
  xxh3: string;
  token_start: number;
  token_end: number;
}

export interface StagedDocument {
  path: string;
  title: string;
  /** Its type, from its content ("PDF", "DOCX", "text"). */
  kind: string;
  /** Bytes of its text. */
  bytes: number;
  /** Bytes of the file on disk. */
  file_bytes: number;
  xxh3: string;
  tokens: number;
  /** Labels of its pages, chapters or sections. */
  parts: string[];
  /** What reading and counting it noticed (an encoding guessed, words the model lacks). */
  warnings: string[];
}

export interface Skip {
  path: string;
  reason: string;
}

export interface Staged {
  documents: StagedDocument[];
  skipped: Skip[];
  head_tokens: number;
  seconds: number;
}

export interface Estimate {
  /** Tokens in the context file. */
  tokens: number;
  /** Tokens the prefill computes: fewer when a change keeps the saved ones. */
  computed_tokens: number;
  limit: number;
  fits: boolean;
  file_bytes: number;
  working_set_bytes: number;
  scratch_bytes: number;
  disk_free_bytes: number | null;
  predicted_seconds: number | null;
  rate_tokens_per_s: number | null;
}

export interface Progress {
  layer: number;
  layers: number;
  layer_tokens: number;
  tokens: number;
  fraction: number;
  tokens_per_s: number;
  eta_s: number | null;
}

export type JobState = 'queued' | 'running' | 'done' | 'paused' | 'failed';

export interface JobView {
  id: number;
  name: string;
  path: string;
  state: JobState;
  progress: Progress | null;
  message: string | null;
  notes: Skip[];
}

export type UiEvent =
  | { event: 'dropped'; data: { paths: string[] } }
  | { event: 'hover'; data: { over: boolean } }
  | { event: 'jobs'; data: { jobs: JobView[] } };

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
export const startPrefill = (documents: StagedDocument[], name: string) =>
  call<number>('start_prefill', { documents, name });
/** A change to a saved context: documents added after its tokens, or one (by path) taken out. */
export type ChangeRequest = { kind: 'add'; documents: StagedDocument[] } | { kind: 'remove'; document: string };
export const estimateChange = (id: number, change: ChangeRequest) => call<Estimate>('estimate_change', { id, change });
export const startChange = (id: number, change: ChangeRequest) => call<number>('start_change', { id, change });
export const resumeContext = (id: number) => call<number>('resume_context', { id });
export const cancelJob = (id: number) => call<boolean>('cancel_job', { id });
export const autoResume = () => call<boolean>('auto_resume');
/** The native file picker; what is picked arrives like a drop (the feed's `dropped`). */
export const pickDocuments = (folders: boolean) => call<void>('pick_documents', { folders });
export const setAutoResume = (on: boolean) => call<void>('set_auto_resume', { on });

/** What an import did: each file listed, or why not. */
export interface Imported {
  imported: ContextInfo[];
  failed: Skip[];
}
/** Verifies context files, copies them into the library's folder and lists them. */
export const importContexts = (paths: string[]) => call<Imported>('import_contexts', { paths });
/** The native picker for context files, then the import. */
export const pickImport = () => call<Imported>('pick_import');
/** The native save dialog, then the copy; null when the dialog was cancelled. */
export const exportContext = (id: number) => call<string | null>('export_context', { id });
/** Whether a dropped path is a context file (imported rather than staged). */
export const isContextFile = (path: string) => /\.folio$/i.test(path);

/** A method named with its budget and knobs (the engine's MethodChoice). */
export interface MethodChoice {
  method: string;
  /** null: the method's default. */
  budget: string | null;
  params: [string, string][];
}

export interface MethodParam {
  name: string;
  default: number;
  min: number;
  max: number;
  integer: boolean;
  doc: string;
}

export interface TierPath {
  path: 'fast' | 'reference' | 'none';
  why?: string;
}

/** A method of the engine's registry. */
export interface MethodSpec {
  name: string;
  summary: string;
  paper: string;
  default_budget: { budget: string; source: string } | null;
  params: MethodParam[];
  needs: { calibration: boolean; index: string | null };
  resident: TierPath;
  offloaded: TierPath;
}

export const methods = () => call<MethodSpec[]>('methods');
export const currentMethod = () => call<MethodChoice>('method');
/** Checked like the CLI's --method; refused, the method stays what it was. */
export const setMethod = (choice: MethodChoice) => call<MethodChoice>('set_method', { choice });

/** How an answer is sampled; null: the model's generation_config.json. */
export interface GenerationSettings {
  max_tokens: number;
  temperature: number | null;
  top_p: number | null;
  top_k: number | null;
  repetition_penalty: number | null;
  seed: number;
  stop: string[];
  /** The system message of a bare-model chat (a context keeps the one it was prefilled with). */
  system: string | null;
}

export const currentGeneration = () => call<GenerationSettings>('generation');
/** Checked as the decode loop checks them; refused, they stay what they were. */
export const setGeneration = (settings: GenerationSettings) => call<GenerationSettings>('set_generation', { settings });

export type { ChatInfo } from './api';

export interface MessageRow {
  position: number;
  role: 'user' | 'assistant';
  content: string;
  details: AnswerDetails | null;
  created_at: string;
}

export interface OpenedChat {
  chat: ChatInfo;
  messages: MessageRow[];
  context: ContextInfo | null;
  /** Why it cannot be continued here; it stays readable. */
  refused: string | null;
}

export const listChats = (search: string | null) => call<ChatInfo[]>('list_chats', { search });
export const openChat = (id: number) => call<OpenedChat>('open_chat', { id });
export const renameChat = (id: number, title: string) => call<ChatInfo>('rename_chat', { id, title });
export const deleteChat = (id: number) => call<void>('delete_chat', { id });
/** A new chat with the first `keep` messages (whole turns), opened. */
export const forkChat = (id: number, keep: number) => call<OpenedChat>('fork_chat', { id, keep });
/** Drops the chat's last answer and its question; returns the question to ask again. */
export const regenerate = (id: number) => call<string>('regenerate', { id });

/** A run of a document's text: read by the attention (its passage's share) or around it. */
export interface Piece {
  text: string;
  read: number | null;
}

/** A document's text at the passages an answer read (tokens from the document's start). */
export interface DocumentExcerpts {
  document: number;
  title: string;
  path: string;
  tokens: number;
  /** `part`: the page, chapter or section an excerpt starts in, when the document has parts. */
  excerpts: { start: number; end: number; part: string | null; pieces: Piece[] }[];
}

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

/** The window's engine settings (src-tauri/src/gui/engine.rs). */
export interface EngineSettings {
  /** auto, cpu, cuda or cuda:N. */
  device: string;
  /** Sizes as the CLI reads them (24GiB); null: no cap. */
  device_budget: string | null;
  host_budget: string | null;
  /** How new contexts store K/V. */
  kv_dtype: string;
  /** Open contexts on the offloaded tier. */
  offload: boolean;
}

export interface DeviceChoice {
  spec: string;
  label: string;
  /** Why it cannot be used here. */
  unavailable: string | null;
}

export interface EngineView {
  settings: EngineSettings;
  running_on: string | null;
  devices: DeviceChoice[];
  kv_dtypes: string[];
}

export const engineSettings = () => call<EngineView>('engine_settings');
/** Checked and applied at once; a device change loads the model again (info: the new app
 *  state). Refused, nothing changes. */
export const setEngineSettings = (settings: EngineSettings) =>
  call<{ engine: EngineView; info: AppInfo | null }>('set_engine_settings', { settings });

/** One path of a decode step: bytes over a measured bandwidth. */
export interface PlanTerm {
  path: 'device' | 'link' | 'host';
  bytes: number;
  bandwidth: number;
  ms: number;
}

/** Where the open context's K/V lives with a method, and what a step costs (plan.rs). */
export interface MemoryPlan {
  tier: 'resident' | 'offloaded';
  method: string;
  budget_tokens: number | null;
  file_bytes: number;
  weights_bytes: number;
  kv_device_bytes: number;
  resident_layers: number;
  layers: number;
  kv_host_bytes: number;
  method_device_bytes: number;
  device_bytes: number;
  host_bytes: number;
  terms: PlanTerm[];
  floor_ms: number;
  binding: string;
  problems: string[];
}

export interface PlanView {
  plan: MemoryPlan;
  bandwidths: { device: number; link: number | null; host: number };
  device: string;
}

/** The planner for the open context with `method` (null: the chat's). */
export const memoryPlan = (method: MethodChoice | null) => call<PlanView>('memory_plan', { method });

/** The context the chat is over, and its default method (what new chats over it start with). */
export const openContextMethod = () =>
  call<{ context: number | null; method: MethodChoice | null }>('open_context_method');
/** Makes the method in use the open context's default. */
export const setContextMethod = () => call<MethodChoice>('set_context_method');

/** A method's index stored in the context file. */
export interface StoredIndex {
  settings: unknown;
  sections: number;
  index_bytes: number;
}

/** Builds the index of the method in use into the open context's file; `onProgress(layer,
 *  layers)` follows it; Stop (cancelChat) stops it with the file unchanged. */
export async function buildIndex(onProgress: (layer: number, layers: number) => void): Promise<StoredIndex> {
  const onEvent = new Channel<{ layer: number; layers: number }>((p) => onProgress(p.layer, p.layers));
  return call('build_index', { onEvent });
}

/** Double Sparsity's channel calibration of the running model: the file read, or why none. */
export interface CalibrationStatus {
  found: string | null;
  missing: string | null;
}

export const calibration = () => call<CalibrationStatus>('calibration');

/** Calibrates the running model on the open context's documents (kept in Folio's home). */
export async function calibrate(onProgress: (done: number, total: number) => void): Promise<CalibrationStatus> {
  const onEvent = new Channel<{ done: number; total: number }>((p) => onProgress(p.done, p.total));
  return call('calibrate', { onEvent });
}

/** A whole model in the Hugging Face cache (loads offline). */
export interface CachedModel {
  repo: string;
  weight_bytes: number;
}

/** A model that made contexts in the library. */
export interface LibraryModel {
  name: string;
  source: string;
  architecture: string;
  fingerprint: string;
  contexts: number;
}

export interface ModelChoices {
  cached: CachedModel[];
  library: LibraryModel[];
}

export const modelChoices = () => call<ModelChoices>('models');
/** Loads a model folder or Hugging Face repo id; the window runs it from the next question on. */
export const loadModel = (spec: string) => call<AppInfo>('load_model', { spec });
/** The native folder dialog, then the load; null when cancelled. */
export const pickModelFolder = () => call<AppInfo | null>('pick_model_folder');

/** What staging is doing: reading the files, then counting their tokens. */
export type StagePhase = 'reading' | 'counting';

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

/** 75 → "1m 15s". */
export function duration(s: number): string {
  if (s < 1) return 'under a second';
  const t = Math.round(s);
  if (t < 60) return `${t}s`;
  if (t < 3600) return `${Math.floor(t / 60)}m ${String(t % 60).padStart(2, '0')}s`;
  return `${Math.floor(t / 3600)}h ${String(Math.floor((t % 3600) / 60)).padStart(2, '0')}m`;
}
