import type { AnswerDetails, DoneInfo, Passage } from './api';

export type Role = 'user' | 'assistant';

/**
 * streaming: tokens still arriving
 * done:      generation ended normally (or hit a limit)
 * stopped:   the user pressed Stop
 * error:     the backend rejected; `error` holds its message
 */
export type MessageStatus = 'streaming' | 'done' | 'stopped' | 'error';

export interface Message {
  id: number;
  role: Role;
  text: string;
  status: MessageStatus;
  error?: string;
  stopReason?: string;
  stats?: DoneInfo;
  /** How the answer was made (saved with it). */
  details?: AnswerDetails;
  /** The message is in the library's chat (forks count saved messages). */
  saved?: boolean;
  /** A comparison with dense attention is running: its steps so far. */
  comparing?: { done: number; total: number };
  /** Why the comparison failed or stopped. */
  compareError?: string;
  /** Its comparison landed in this window just now (scrolled into view once). */
  justCompared?: boolean;
}

/** A source under an answer, as clicked: the document, and where and over which version of
 *  the context the answer read it. */
export interface SourceRef {
  document: number;
  title: string;
  path: string;
  percent: string;
  /** Where the heaviest passage is ("p. 12", a chapter), when the document has parts. */
  part: string | null;
  passages: Passage[];
  context: string | null;
}
