//! Whether this machine can run Folio's CUDA code, which GPUs it has, and — when it cannot — why,
//! in words a person can act on.
//!
//! Why here and first: Folio's CUDA build opens the NVIDIA libraries at run time (cudarc's
//! `dynamic-loading`, third_party/README.md), so one build runs everywhere; but cudarc panics
//! when a library it needs does not open, at whatever CUDA call comes first. Everything that
//! picks a device asks [`cuda_devices`] before any CUDA call: it opens each library, checks that
//! the driver is new enough for the kernels' PTX and that each GPU's compute capability is one
//! the kernels are built for, and answers the usable GPUs or the reason there are none. The
//! answer is worked out once per process.
//!
//! The CUDA libraries other than the driver's (cuBLAS, cuBLASLt, cuRAND, NVRTC) come with the
//! CUDA toolkit, whose installers put them in `/usr/local/cuda/lib64` without always telling the
//! dynamic loader; a library not found by its name is looked for there (and under `$CUDA_HOME`,
//! `$CUDA_PATH`) and opened by its path, after which cudarc's open by name finds it loaded.

use std::sync::OnceLock;

/// A GPU Folio can run on.
#[derive(Debug, Clone)]
pub struct CudaGpu {
    pub ordinal: usize,
    pub name: String,
    /// Compute capability, major and minor.
    pub compute: (i32, i32),
    pub memory_bytes: u64,
}

/// The usable GPUs (at least one), or why there is none.
pub type CudaDevices = Result<Vec<CudaGpu>, String>;

/// The lowest compute capability the kernels can be built for (kernels/build.rs): PTX for
/// `compute_80` is compiled by the driver for 8.0 and every newer GPU — Ampere, Ada, Hopper,
/// Blackwell — on first use.
pub const MIN_COMPUTE: (i32, i32) = (8, 0);

/// The lowest compute capability this build's kernels run on: `CUDA_COMPUTE_CAP` as the build
/// was given it (scripts/cuda-toolchain.sh: 80 unless set), else [`MIN_COMPUTE`].
pub fn min_compute() -> (i32, i32) {
    let cap: i32 = option_env!("CUDA_COMPUTE_CAP").and_then(|c| c.parse().ok()).unwrap_or(80);
    (cap / 10, cap % 10).max(MIN_COMPUTE)
}

/// The CUDA version of the toolkit that compiles the kernels (scripts/cuda-toolchain.sh pins
/// nvcc 13.0): its PTX loads only on a driver that supports this version or a later one.
pub const KERNELS_CUDA_VERSION: i32 = 13_000;

/// The first NVIDIA driver release that supports [`KERNELS_CUDA_VERSION`].
pub const KERNELS_MIN_DRIVER: &str = "580";

/// The usable GPUs, or why there is none; worked out at the first call.
pub fn cuda_devices() -> &'static CudaDevices {
    static DEVICES: OnceLock<CudaDevices> = OnceLock::new();
    DEVICES.get_or_init(probe)
}

/// Why the CUDA device cannot be used (a reason, not a sentence about the CPU: callers say what
/// they do instead), or `None` when it can.
pub fn cuda_unavailable() -> Option<&'static str> {
    cuda_devices().as_ref().err().map(String::as_str)
}

#[cfg(not(feature = "cuda"))]
fn probe() -> CudaDevices {
    Err("this build of Folio has no CUDA support (./scripts/run.sh builds one that has)".into())
}

#[cfg(feature = "cuda")]
fn probe() -> CudaDevices {
    cuda::probe()
}

/// A CUDA version as the driver API gives it (12040) in the words people use ("12.4").
pub fn cuda_version_words(version: i32) -> String {
    format!("{}.{}", version / 1000, (version % 1000) / 10)
}

#[cfg(feature = "cuda")]
mod cuda {
    use candle_core::cuda::cudarc;
    use cudarc::driver::{result, sys};

    use super::{cuda_version_words, min_compute, CudaDevices, CudaGpu, KERNELS_CUDA_VERSION, KERNELS_MIN_DRIVER};

    /// A library cudarc opens by name: what a person would call it, its file for the CUDA major
    /// version the build is for (Linux), and cudarc's check that one of its candidate names
    /// opens (used where the exact file cannot be opened: not Unix).
    struct Library {
        what: &'static str,
        file: &'static str,
        #[cfg_attr(unix, allow(dead_code))]
        present: unsafe fn() -> bool,
    }

    const DRIVER: Library =
        Library { what: "the NVIDIA driver", file: "libcuda.so.1", present: cudarc::driver::sys::is_culib_present };

    /// The toolkit's libraries candle's CUDA backend calls.
    const TOOLKIT: [Library; 4] = [
        Library { what: "cuBLAS", file: "libcublas.so.13", present: cudarc::cublas::sys::is_culib_present },
        Library { what: "cuBLASLt", file: "libcublasLt.so.13", present: cudarc::cublaslt::sys::is_culib_present },
        Library { what: "cuRAND", file: "libcurand.so.10", present: cudarc::curand::sys::is_culib_present },
        Library { what: "NVRTC", file: "libnvrtc.so.13", present: cudarc::nvrtc::sys::is_culib_present },
    ];

    /// Where the CUDA toolkit's installers put its libraries, beside the loader's own paths.
    #[cfg(unix)]
    const TOOLKIT_DIRS: [&str; 3] = ["/usr/local/cuda/lib64", "/usr/local/cuda/lib", "/usr/lib/cuda/lib64"];

    pub(super) fn probe() -> CudaDevices {
        if !opens(&DRIVER) {
            return Err(format!("no NVIDIA driver found ({} does not open)", DRIVER.file));
        }
        for library in &TOOLKIT {
            if !opens(library) {
                return Err(format!(
                    "the NVIDIA driver is installed but the CUDA toolkit's {} library ({}) was not found: install \
                     the CUDA {} runtime libraries, or set LD_LIBRARY_PATH to the folder that has them",
                    library.what,
                    library.file,
                    cuda_version_words(KERNELS_CUDA_VERSION)
                ));
            }
        }
        result::init().map_err(|e| match e.0 {
            sys::cudaError_enum::CUDA_ERROR_NO_DEVICE => {
                "the NVIDIA driver is installed but reports no GPU (is CUDA_VISIBLE_DEVICES hiding them?)".to_owned()
            }
            _ => format!("the NVIDIA driver did not start: {e}"),
        })?;
        let version = driver_version()?;
        if version < KERNELS_CUDA_VERSION {
            return Err(format!(
                "the NVIDIA driver supports CUDA {}, Folio's GPU code needs CUDA {} (driver {KERNELS_MIN_DRIVER} \
                 or newer): update the driver",
                cuda_version_words(version),
                cuda_version_words(KERNELS_CUDA_VERSION)
            ));
        }
        let count = result::device::get_count().map_err(|e| format!("counting CUDA devices failed: {e}"))?;
        let (mut usable, mut too_old, mut unreadable) = (Vec::new(), None, None);
        for ordinal in 0..count.max(0) {
            // A GPU that cannot be read is left out; the others may serve.
            let gpu = match describe(ordinal) {
                Ok(gpu) => gpu,
                Err(why) => {
                    unreadable.get_or_insert(why);
                    continue;
                }
            };
            if gpu.compute >= min_compute() {
                usable.push(gpu);
            } else {
                too_old.get_or_insert(gpu);
            }
        }
        match (usable.is_empty(), too_old) {
            (false, _) => Ok(usable),
            (true, Some(gpu)) => Err(format!(
                "{} is compute capability {}.{}; this build of Folio's GPU code needs {}.{} or newer",
                gpu.name,
                gpu.compute.0,
                gpu.compute.1,
                min_compute().0,
                min_compute().1
            )),
            (true, None) => {
                Err(unreadable.unwrap_or_else(|| "the NVIDIA driver is installed but reports no GPU".into()))
            }
        }
    }

    /// Whether `library`'s own file (the build's CUDA major version: cudarc, left to itself, would
    /// also take another major's, whose functions differ) opens by name, or else from a toolkit
    /// folder; it is kept open, so that cudarc's open by name finds it loaded. cudarc tries the
    /// unversioned name (`libcublas.so`) first: where that name opens another library — a
    /// development link to another major — cudarc would load that one, so it counts as not found.
    #[cfg(unix)]
    fn opens(library: &Library) -> bool {
        let homes = ["CUDA_HOME", "CUDA_PATH"]
            .into_iter()
            .filter_map(std::env::var_os)
            .map(|h| std::path::PathBuf::from(h).join("lib64"));
        let in_dirs = homes.chain(TOOLKIT_DIRS.iter().map(Into::into)).map(|d| d.join(library.file));
        let Some(handle) =
            std::iter::once(std::path::PathBuf::from(library.file)).chain(in_dirs).find_map(|p| dlopen(&p))
        else {
            return false;
        };
        let unversioned = library.file.split(".so").next().map(|stem| format!("{stem}.so"));
        match unversioned.and_then(|name| dlopen(std::path::Path::new(&name))) {
            Some(other) => other == handle,
            None => true,
        }
    }

    /// `dlopen` of `path` (a name or a path), kept open; its handle, the same for a library
    /// already loaded under that name or soname.
    #[cfg(unix)]
    fn dlopen(path: &std::path::Path) -> Option<usize> {
        let c_path = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).ok()?;
        // SAFETY: dlopen of a CUDA library, never closed (it stays for cudarc's use).
        let handle = unsafe { libc::dlopen(c_path.as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL) };
        (!handle.is_null()).then_some(handle as usize)
    }

    #[cfg(not(unix))]
    fn opens(library: &Library) -> bool {
        // SAFETY: cudarc's check only tries to open the library by its names and closes it.
        unsafe { (library.present)() }
    }

    fn driver_version() -> Result<i32, String> {
        let mut version = 0;
        // SAFETY: the driver is initialised; the call writes one int.
        unsafe { sys::cuDriverGetVersion(&mut version) }
            .result()
            .map_err(|e| format!("asking the NVIDIA driver its version failed: {e}"))?;
        Ok(version)
    }

    fn describe(ordinal: i32) -> Result<CudaGpu, String> {
        let failed = |e: cudarc::driver::DriverError| format!("reading CUDA device {ordinal} failed: {e}");
        let device = result::device::get(ordinal).map_err(failed)?;
        let attribute = |a| {
            // SAFETY: `device` came from cuDeviceGet.
            unsafe { result::device::get_attribute(device, a) }.map_err(failed)
        };
        let major = attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?;
        let minor = attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?;
        // SAFETY: as above.
        let memory = unsafe { result::device::total_mem(device) }.map_err(failed)?;
        Ok(CudaGpu {
            ordinal: ordinal as usize,
            name: result::device::get_name(device).map_err(failed)?,
            compute: (major, minor),
            memory_bytes: memory as u64,
        })
    }
}
