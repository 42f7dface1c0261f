//! `folio`: with no subcommand, the desktop window (feature `gui`); with one, headless work
//! for scripts and servers. Every headless command takes `--json` and then prints exactly one
//! JSON document on stdout; errors go to stderr with a non-zero exit code.
//!
//! Rules of this crate (docs/architecture.md): it is the product layer — argument parsing,
//! progress bars, JSON, the window, reading documents from disk — over the engine's API
//! (`folio_models`); it holds no decode logic and names no attention method (both read
//! `folio_models::attention::REGISTRY` and call `folio_models::session`).

mod bench;
mod calibrate_cmd;
mod cli;
mod context_cmd;
mod eval;
#[cfg(feature = "gui")]
mod gui;
mod ingest;
mod library_cmd;
mod listing;
mod logging;
mod serve_cmd;

use clap::{Parser, Subcommand};

/// The system allocator, with a bound on what a model's chat template may take while it renders
/// (folio_runtime::alloc_guard says why the allocator).
#[global_allocator]
static ALLOCATOR: folio_runtime::alloc_guard::GuardedAlloc = folio_runtime::alloc_guard::GuardedAlloc;

#[derive(Parser)]
#[command(name = "folio", version, about = "Chat with a local LLM over whole document collections")]
struct Cli {
    /// Model: a Hugging Face model folder, a GGUF file (llama.cpp's, e.g. model-Q4_K_M.gguf), or
    /// a repo id (owner/name[@revision]) from the HF cache or hub. The desktop window uses it too.
    #[arg(long, global = true)]
    model: Option<String>,
    /// auto, cpu, cuda or cuda:N.
    #[arg(long, global = true, default_value = "auto")]
    device: String,
    /// Compute dtype: auto (f32 on CPU, bf16 on GPU), f32, bf16 or f16.
    #[arg(long, global = true, default_value = "auto")]
    dtype: String,
    /// Quantize a safetensors model's projections as it loads: q8_0 (about half of bf16's
    /// memory) or q4k (about 30%); a context made with them must be read with them.
    #[arg(long, global = true)]
    quantize: Option<String>,
    /// Read a context made with other weights of the same model (another quantisation or
    /// fine-tune: same architecture, shapes and tokenizer) instead of refusing it. Its K/V stay
    /// what those weights computed, so answers differ from a prefill with these.
    #[arg(long, global = true)]
    accept_other_weights: bool,
    /// Host memory the whole process may take (4GiB, 60GiB): the K/V in host memory, a
    /// method's state (MagicPIG's tables), pinned buffers and the app. What would pass it is
    /// refused with what is in use. Default: what the machine has, less the larger of 2 GiB and
    /// a tenth of its memory. The window's Settings → Engine overrides it when set there.
    #[arg(long, global = true, value_name = "SIZE")]
    host_budget: Option<String>,
    /// Emulate a slower host link, in GB/s (25: PCIe 4.0 x16, an RTX 4090's): every read of host
    /// memory over the link (the offloaded tier's gathers, HiP's search, MagicPIG's walk and
    /// sample) is held on the GPU until its bytes would have crossed a link of this rate. For
    /// measuring a consumer machine on a faster one (`folio bench link` checks the rate).
    #[arg(long, global = true, value_name = "GBPS")]
    link_gbps: Option<f64>,
    /// Emulate another disk for the context file's reads, in GB/s (with --disk-iops; 5 and
    /// 500000: a laptop's PCIe 4.0 NVMe): the file is read through the page cache and each read
    /// held until such a disk would have served it. For measuring a laptop on a machine without
    /// an NVMe (the file must fit in the page cache; `folio bench` reports reads it served late).
    #[arg(long, global = true, value_name = "GBPS", requires = "disk_iops")]
    disk_gbps: Option<f64>,
    /// The emulated disk's random reads a second (with --disk-gbps).
    #[arg(long, global = true, value_name = "READS", requires = "disk_gbps")]
    disk_iops: Option<f64>,
    /// Context files to open in the window (what the desktop passes when a .folio file is
    /// opened): each is verified and imported into the library.
    #[arg(value_name = "FILE.folio")]
    files: Vec<std::path::PathBuf>,
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Subcommand)]
enum Command {
    /// Ask the model a question (streams the answer), optionally over a saved context.
    Chat(cli::ChatArgs),
    /// Prefill documents into a context file (resumable; reopen it with `chat --context`).
    Prefill(context_cmd::PrefillArgs),
    /// Inspect context files.
    #[command(subcommand)]
    Context(context_cmd::ContextCommand),
    /// The library of contexts the window shows (FOLIO_HOME, else the platform's data folder).
    #[command(subcommand)]
    Library(library_cmd::LibraryCommand),
    /// Benchmarks that print figures with their ratio to the hardware limit: `--shape` (decode
    /// over an offloaded context with a real model's shape), `prefill`, `kernels`.
    Bench(bench::BenchArgs),
    /// Perplexity of a text file under the model.
    Perplexity(cli::PerplexityArgs),
    /// Architecture, size and context facts of a model.
    Info(cli::InfoArgs),
    /// The attention methods: paper, default budget, knobs, and which tiers run them.
    Methods(cli::MethodsArgs),
    /// Measure answer quality (needle-in-a-haystack accuracy per length and depth).
    Eval(eval::EvalArgs),
    /// A local OpenAI-compatible API (/v1/chat/completions, /v1/completions, /v1/models) over
    /// the model and every saved context of the library (model id `context:NAME`).
    Serve(serve_cmd::ServeArgs),
    /// Measure which channels of q·k carry the scores (for --method double-sparsity); writes
    /// folio-channels.json next to the model.
    Calibrate(calibrate_cmd::CalibrateArgs),
}

/// The log target of a command's failure: in the file, not again on stderr (printed there as
/// `error: …` already).
const EXIT_TARGET: &str = "folio::exit";
/// The slowest link `--link-gbps` emulates: slower, a step's wait would pass the pace kernel's
/// bound (kernels/cuda/link.cu) and stop being the rate asked for.
const MIN_LINK_GBPS: f64 = 0.1;
/// Whether the emulated disk's rates given are ones it emulates.
fn disk_rates_ok(gbps: Option<f64>, iops: Option<f64>) -> bool {
    use folio_runtime::disk::{MIN_BYTES_PER_S, MIN_READS_PER_S};
    gbps.is_none_or(|r| r.is_finite() && r * 1e9 >= MIN_BYTES_PER_S)
        && iops.is_none_or(|r| r.is_finite() && r >= MIN_READS_PER_S)
}

/// What `folio serve` shows on stderr when `RUST_LOG` does not say: a line per request.
const SERVE_STDERR_LOG: &str = "info,folio::exit=off";

fn main() {
    ignore_file_size_signal();
    let args = Cli::parse();
    let log = logging::start(match &args.command {
        None => None,
        Some(Command::Serve(_)) => Some(SERVE_STDERR_LOG),
        Some(_) => Some("off"),
    });
    let budget = args.host_budget.as_deref().map(context_cmd::parse_bytes).transpose();
    let result = match budget {
        Err(e) => Err(e.context("--host-budget")),
        Ok(_) if args.link_gbps.is_some_and(|r| !(r.is_finite() && r >= MIN_LINK_GBPS)) => {
            Err(anyhow::anyhow!("--link-gbps must be a rate of at least {MIN_LINK_GBPS} GB/s (25: PCIe 4.0 x16)"))
        }
        Ok(_) if !disk_rates_ok(args.disk_gbps, args.disk_iops) => Err(anyhow::anyhow!(
            "--disk-gbps and --disk-iops must be at least {} GB/s and {} reads a second (5 and 500000: a PCIe 4.0 NVMe)",
            folio_runtime::disk::MIN_BYTES_PER_S / 1e9,
            folio_runtime::disk::MIN_READS_PER_S
        )),
        Ok(budget) => {
            folio_runtime::host_budget::set_budget(budget);
            folio_kernels::link::set_rate(args.link_gbps.map(|r| r * 1e9));
            let disk = args.disk_gbps.zip(args.disk_iops);
            folio_runtime::disk::set_rate(
                disk.map(|(rate, iops)| folio_runtime::disk::DiskRate { bytes_per_s: rate * 1e9, reads_per_s: iops }),
            );
            run(args)
        }
    };
    if let Err(e) = result {
        tracing::error!(target: EXIT_TARGET, error = format!("{e:#}"), "failed");
        eprintln!("error: {e:#}");
        // The log's writer thread flushes when its guard drops; `exit` runs no destructors.
        drop(log);
        std::process::exit(1);
    }
}

/// The command `args` name, or the window.
fn run(args: Cli) -> anyhow::Result<()> {
    match args.command {
        // The window and the server open only contexts of the weights they load: the flag would
        // do nothing there, so it is refused rather than ignored.
        None | Some(Command::Serve(_)) if args.accept_other_weights => Err(anyhow::anyhow!(
            "--accept-other-weights is for the commands that read one context (chat, eval); the window and \
             `folio serve` open only contexts made with the weights they load"
        )),
        Some(cmd) => {
            let common = cli::Common {
                model: args.model,
                device: args.device,
                dtype: args.dtype,
                quantize: args.quantize,
                accept_other_weights: args.accept_other_weights,
            };
            match cmd {
                Command::Chat(a) => cli::chat(&common, a),
                Command::Prefill(a) => context_cmd::prefill(&common, a),
                Command::Context(c) => context_cmd::context(&common, c),
                Command::Library(c) => library_cmd::library(c),
                Command::Bench(b) => bench::bench(&common, b),
                Command::Perplexity(a) => cli::perplexity(&common, a),
                Command::Info(a) => cli::info(&common, a),
                Command::Methods(a) => cli::methods(a),
                Command::Eval(a) => eval::eval(&common, a),
                Command::Calibrate(a) => calibrate_cmd::calibrate(&common, a),
                Command::Serve(a) => serve_cmd::serve(&common, a, bundled_demo_model()),
            }
        }
        None => desktop(args.model, &args.device, &args.dtype, args.files),
    }
}

/// A write past a file-size limit (RLIMIT_FSIZE) kills a process with SIGXFSZ by default;
/// ignored, the write fails with EFBIG instead, which Folio reports like a full disk and cleans
/// up after (docs/architecture.md: a failed save leaves nothing half-written).
fn ignore_file_size_signal() {
    #[cfg(unix)]
    // SAFETY: setting a signal's disposition to SIG_IGN at start-up, before any thread exists.
    unsafe {
        libc::signal(libc::SIGXFSZ, libc::SIG_IGN);
    }
}

/// The demo model as a build from source has it (assets/models/demo).
const SOURCE_DEMO_MODEL: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../assets/models/demo");
/// Where an installed package puts it beside the binary: `/usr/lib/Folio/models/demo` for
/// `/usr/bin/folio` (the .deb; the AppImage's tree has the same shape under `$APPDIR/usr`).
const INSTALLED_DEMO_MODEL: &str = "../lib/Folio/models/demo";

/// The bundled demo model, used by the desktop window and `folio serve` when neither
/// `--model` nor `FOLIO_MODEL` names one (and, in the window, no model was loaded in it
/// before): an installed package's copy first, else the source tree's.
fn bundled_demo_model() -> Option<String> {
    let exe = std::env::current_exe().ok();
    let installed = exe.as_deref().and_then(std::path::Path::parent).map(|bin| bin.join(INSTALLED_DEMO_MODEL));
    installed
        .into_iter()
        .chain([std::path::PathBuf::from(SOURCE_DEMO_MODEL)])
        .find(|p| p.join("config.json").is_file())
        .map(|p| p.canonicalize().unwrap_or(p).display().to_string())
}

#[cfg(feature = "gui")]
fn desktop(model: Option<String>, device: &str, dtype: &str, files: Vec<std::path::PathBuf>) -> anyhow::Result<()> {
    // A mistyped command reads as a file: say so rather than open the window on it.
    let is_context =
        |f: &std::path::Path| f.is_file() && f.extension().is_some_and(|e| e.eq_ignore_ascii_case("folio"));
    if let Some(f) = files.iter().find(|f| !is_context(f)) {
        anyhow::bail!(
            "{}: neither a command nor a context file (.folio); `folio --help` lists the commands",
            f.display()
        );
    }
    let model = model.or_else(|| std::env::var("FOLIO_MODEL").ok().filter(|m| !m.is_empty()));
    gui::run(model, bundled_demo_model(), device, dtype, files)
}

#[cfg(not(feature = "gui"))]
fn desktop(_: Option<String>, _: &str, _: &str, _: Vec<std::path::PathBuf>) -> anyhow::Result<()> {
    anyhow::bail!("this build of folio has no desktop window (built without the `gui` feature); run `folio --help` for the headless commands")
}
