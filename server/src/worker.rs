//! The device answers one request at a time: a thread owns the sessions and takes requests
//! from a bounded queue. Why one at a time: a request's K/V, method state and working set are
//! sized for the device alone (the memory planner's figures assume it), and a second forward
//! pass beside it would only share the same GPU at the cost of both. Why bounded: a client
//! that floods the server gets 429 at once instead of waiting behind everyone; the queue's
//! length is the wait a person accepts.
//!
//! A request whose client has gone (its receiver dropped) is skipped before it starts and
//! stopped between tokens while it runs. The sessions stay between requests: the bare model's,
//! and the last context's (a context is opened once, not per request), each keeping the K/V of
//! the turns it computed, so a client that sends the whole conversation again (as OpenAI's
//! API does) has only its new turn computed.

use std::ops::ControlFlow;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender, TrySendError};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};

use crate::error::ApiError;
use crate::openai::Turns;
use folio_models::attention::{MethodChoice, Tier};
use folio_models::generate::StopReason;
use folio_models::session::{GenerationSettings, Session};
use folio_models::Engine;

/// What a request asks the model.
pub enum Work {
    /// A chat turn over the bare model (`context: None`) or a saved context.
    Chat { context: Option<PathBuf>, turns: Turns, method: MethodChoice, settings: GenerationSettings },
    /// Raw text continued by the bare model with dense attention (no chat template).
    Complete { prompt: String, settings: GenerationSettings },
}

/// What a running request reports, in order: text pieces, then `Done` or `Failed`.
pub enum Event {
    Text(String),
    Done(Finished),
    Failed(ApiError),
}

/// How an answer ended and what it cost.
pub struct Finished {
    pub stop_reason: StopReason,
    /// Tokens the model read for it: the saved context's, the conversation's and the
    /// question's (of which `reused_tokens` were held from an earlier request).
    pub prompt_tokens: usize,
    pub reused_tokens: usize,
    pub completion_tokens: usize,
    /// The method's full settings (budget resolved), as the answer's provenance.
    pub method: serde_json::Value,
    /// Over a saved context, which prefill computed which of its tokens (dense or sparse:
    /// a sparse prefill's answers say so).
    pub prefill: Option<serde_json::Value>,
    pub first_token_s: Option<f64>,
    pub seconds: f64,
    /// Seconds the request waited in the queue.
    pub queued_s: f64,
}

struct Job {
    work: Work,
    out: UnboundedSender<Event>,
    queued: Instant,
}

/// The way into the worker's queue.
#[derive(Clone)]
pub struct Queue {
    tx: SyncSender<Job>,
    capacity: usize,
}

impl Queue {
    /// Queues `work`, or refuses it at once when `capacity` requests already wait (429);
    /// the answer's events come on the receiver.
    pub fn submit(&self, work: Work) -> Result<UnboundedReceiver<Event>, ApiError> {
        let (out, events) = unbounded_channel();
        match self.tx.try_send(Job { work, out, queued: Instant::now() }) {
            Ok(()) => Ok(events),
            Err(TrySendError::Full(_)) => Err(ApiError::busy(self.capacity)),
            Err(TrySendError::Disconnected(_)) => Err(ApiError::gone()),
        }
    }
}

/// Starts the worker thread over `engine`; it ends when every [`Queue`] is dropped.
pub fn start(engine: Arc<Engine>, capacity: usize, tier: Tier, delay: Duration, stopping: Arc<AtomicBool>) -> Queue {
    let (tx, rx) = sync_channel(capacity);
    let worker = Worker { engine, tier, delay, bare: None, context: None, stopping };
    std::thread::Builder::new()
        .name("folio-serve".into())
        .spawn(move || worker.run(rx))
        .expect("spawning the server's worker thread");
    Queue { tx, capacity }
}

struct Worker {
    engine: Arc<Engine>,
    tier: Tier,
    delay: Duration,
    bare: Option<Session>,
    /// The last context asked about, by path, open on `tier`.
    context: Option<(PathBuf, Session)>,
    /// Set when the server stops: the running answer ends, the waiting ones are refused.
    stopping: Arc<AtomicBool>,
}

impl Worker {
    fn run(mut self, jobs: Receiver<Job>) {
        while let Ok(job) = jobs.recv() {
            if job.out.is_closed() {
                tracing::info!("a request whose client had gone was dropped before it started");
                continue;
            }
            if self.stopping.load(Ordering::SeqCst) {
                let _ = job.out.send(Event::Failed(ApiError::gone()));
                continue;
            }
            let queued_s = job.queued.elapsed().as_secs_f64();
            let out = job.out.clone();
            // A panic in the engine answers this request with an error and leaves the worker
            // serving the next (the sessions are dropped: they may hold half a turn).
            let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| match job.work {
                Work::Chat { context, turns, method, settings } => {
                    self.chat(context, turns, &method, settings, &job.out)
                }
                Work::Complete { prompt, settings } => self.complete(&prompt, &settings, &job.out),
            }))
            .unwrap_or_else(|_| {
                (self.bare, self.context) = (None, None);
                Err(ApiError::internal("the engine failed on this request (a panic; see the log)"))
            });
            let _ = out.send(match result {
                Ok(done) => Event::Done(Finished { queued_s, ..done }),
                Err(e) => Event::Failed(e),
            });
        }
    }

    /// The session for `context` (opened on first use; the previous context's is closed
    /// first, so that two contexts never hold memory at once).
    fn session(&mut self, context: Option<PathBuf>) -> Result<&mut Session, ApiError> {
        let Some(path) = context else {
            return Ok(self.bare.get_or_insert_with(|| Session::bare(self.engine.clone())));
        };
        if self.context.as_ref().is_none_or(|(open, _)| *open != path) {
            self.context = None;
            let session = Session::open(self.engine.clone(), &path, self.tier)?;
            self.context = Some((path, session));
        }
        Ok(&mut self.context.as_mut().expect("opened above").1)
    }

    fn chat(
        &mut self,
        context: Option<PathBuf>,
        turns: Turns,
        method: &MethodChoice,
        mut settings: GenerationSettings,
        out: &UnboundedSender<Event>,
    ) -> Result<Finished, ApiError> {
        let (delay, stopping) = (self.delay, self.stopping.clone());
        let session = self.session(context)?;
        let mut conversation = session.new_conversation();
        conversation.messages = turns.history;
        // A bare chat takes the request's system message; a context answers with the one it
        // was prefilled with, and the session refuses another by name.
        settings.system = turns.system;
        let saved = session.context().map_or(0, |f| f.tokens().len());
        let prefill = session.context().map(|f| serde_json::json!(f.header().prefill_runs()));
        let answer = session
            .ask(&mut conversation, &turns.question, method, &settings, |piece| send(out, piece, delay, &stopping))?;
        Ok(Finished {
            stop_reason: answer.stop_reason,
            prompt_tokens: saved + answer.tail_tokens.len(),
            reused_tokens: saved + answer.reused_tokens,
            completion_tokens: answer.tokens.len(),
            method: answer.settings,
            prefill,
            first_token_s: answer.timings.first_token_s,
            seconds: answer.timings.seconds,
            queued_s: 0.0,
        })
    }

    fn complete(
        &mut self,
        prompt: &str,
        settings: &GenerationSettings,
        out: &UnboundedSender<Event>,
    ) -> Result<Finished, ApiError> {
        let engine = &self.engine;
        let ids = engine.tokenizer.encode_raw(prompt)?;
        let (delay, stopping) = (self.delay, &self.stopping);
        let g = engine.generate(&ids, &settings.params(engine), |piece| send(out, piece, delay, stopping))?;
        Ok(Finished {
            stop_reason: g.stop_reason,
            prompt_tokens: ids.len(),
            reused_tokens: 0,
            completion_tokens: g.tokens.len(),
            method: serde_json::json!({ "method": "dense" }),
            prefill: None,
            first_token_s: g.first_token_s,
            seconds: g.seconds,
            queued_s: 0.0,
        })
    }
}

/// Sends a piece of the answer; a client that has gone, or the server stopping, stops it.
fn send(out: &UnboundedSender<Event>, piece: &str, delay: Duration, stopping: &AtomicBool) -> ControlFlow<()> {
    if !delay.is_zero() {
        std::thread::sleep(delay);
    }
    if stopping.load(Ordering::SeqCst) {
        return ControlFlow::Break(());
    }
    match out.send(Event::Text(piece.to_owned())) {
        Ok(()) => ControlFlow::Continue(()),
        Err(_) => ControlFlow::Break(()),
    }
}
