//! Which device the engine runs on, from the words a person or a setting gives (`auto`, `cpu`,
//! `cuda:N`), and the dtype that suits it. One parser for the CLI's `--device` and the window's
//! setting, so both refuse the same bad values with the same words.

use candle_core::{DType, Device};
use folio_runtime::gpu::cuda_devices;

use crate::error::{Error, Result};

/// `auto` (the first usable GPU, else the CPU), `cpu`, `cuda` or `cuda:N`. A GPU asked for by
/// name that cannot be used is refused with the reason ([`folio_runtime::gpu::cuda_devices`]:
/// no driver, a library missing, a driver too old, a GPU too old), never run on the CPU instead.
pub fn parse_device(spec: &str) -> Result<Device> {
    let bad = || Error::Invalid(format!("bad device \"{spec}\": use auto, cpu, cuda or cuda:N"));
    match spec {
        "cpu" => Ok(Device::Cpu),
        "auto" => match cuda_devices() {
            Ok(gpus) => Ok(cuda_device(gpus[0].ordinal).unwrap_or(Device::Cpu)),
            Err(_) => Ok(Device::Cpu),
        },
        _ => {
            let ordinal: usize = match spec.strip_prefix("cuda") {
                Some("") => 0,
                Some(rest) => rest.strip_prefix(':').and_then(|n| n.parse().ok()).ok_or_else(bad)?,
                None => return Err(bad()),
            };
            let gpus =
                cuda_devices().as_ref().map_err(|why| Error::Invalid(format!("device {spec} asked for, but {why}")))?;
            if !gpus.iter().any(|g| g.ordinal == ordinal) {
                let have: Vec<String> = gpus.iter().map(|g| format!("cuda:{} ({})", g.ordinal, g.name)).collect();
                return Err(Error::Invalid(format!(
                    "device {spec} asked for, but this machine's usable GPUs are {}",
                    have.join(", ")
                )));
            }
            cuda_device(ordinal)
        }
    }
}

/// The CUDA device `ordinal` as the engine runs it: without cudarc's per-allocation events.
/// cudarc gives each device allocation a read and a write event (two `cuEventCreate` on
/// allocation, two destroys on free) so that, once a context has a second stream, every launch
/// can order each buffer's uses across streams by recording and waiting on them. Folio runs
/// everything on candle's one stream except HiP's search a step ahead, which orders its few
/// buffers by hand (`folio_kernels::select::HostRows::search_blocks`: the side stream joins
/// candle's before the launch, candle's waits on the search's event before reading its
/// output, and its inputs live until then), and the copy of its positions to the host for the
/// file tier's read-ahead (on a third stream, after an event that follows the search; the copy
/// holds the positions' tensor until it is done). With tracking on, a decode step — hundreds of small
/// allocations — paid for the events on the host that queues the GPU's work, and, once the side
/// stream existed, an event record and wait per buffer of every launch. Page-locked host rows
/// are written only while a tier is filled (each write synchronises) and freed after the
/// context is synchronised (`Mapped`'s and `Registered`'s drops), so they need no event either.
pub fn cuda_device(ordinal: usize) -> Result<Device> {
    let device = Device::new_cuda(ordinal)?;
    #[cfg(feature = "cuda")]
    if let Device::Cuda(cuda) = &device {
        // SAFETY: cudarc's rules for turning tracking off — no use of a buffer on another
        // stream before its allocation or after its free, no concurrent writes from two
        // streams — hold: candle's work is on one stream, and the uses of the others (above)
        // order their buffers with events and keep them alive themselves.
        unsafe { cuda.disable_event_tracking() };
    }
    Ok(device)
}

/// `f32`, `bf16`, `f16`, or `auto`: f32 on CPU (candle's CPU kernels are fastest and exact
/// there), bf16 on a GPU.
pub fn parse_dtype(spec: &str, device: &Device) -> Result<DType> {
    match spec {
        "auto" => Ok(if device.is_cpu() { DType::F32 } else { DType::BF16 }),
        "f32" => Ok(DType::F32),
        "bf16" => Ok(DType::BF16),
        "f16" => Ok(DType::F16),
        _ => Err(Error::Invalid(format!("bad dtype \"{spec}\": use auto, f32, bf16 or f16"))),
    }
}

pub fn device_name(device: &Device) -> String {
    match device {
        Device::Cpu => "cpu".into(),
        Device::Cuda(_) => "cuda".into(),
        Device::Metal(_) => "metal".into(),
    }
}
