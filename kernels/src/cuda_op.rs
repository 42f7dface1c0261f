//! candle custom ops that run on CUDA only. Each hand-written kernel has a CPU reference that
//! the CPU path calls directly, so its op never runs on the CPU: an op states only its CUDA
//! launch (`CudaOp1`/`2`/`3`) and [`CudaOnly`] gives candle the rest — the name, and a CPU
//! entry point that refuses — instead of each op repeating that boilerplate.

use candle_core::{CpuStorage, CudaStorage, CustomOp1, CustomOp2, CustomOp3, Layout, Result, Shape, Storage};

/// The CUDA storage of a tensor an op carries beside its inputs (`what` names it in the error
/// when it is elsewhere).
pub fn cuda_storage<'a>(s: &'a Storage, what: &str) -> Result<&'a CudaStorage> {
    match s {
        Storage::Cuda(c) => Ok(c),
        _ => candle_core::bail!("{what} must be on the CUDA device"),
    }
}

pub trait CudaOp1: Send + Sync {
    const NAME: &'static str;
    fn cuda_fwd(&self, a: &CudaStorage, al: &Layout) -> Result<(CudaStorage, Shape)>;
}

pub trait CudaOp2: Send + Sync {
    const NAME: &'static str;
    fn cuda_fwd(&self, a: &CudaStorage, al: &Layout, b: &CudaStorage, bl: &Layout) -> Result<(CudaStorage, Shape)>;
}

/// Three inputs, each with its layout (an array, so that the launches do not spell out six
/// parameters each).
pub trait CudaOp3: Send + Sync {
    const NAME: &'static str;
    fn cuda_fwd(&self, inputs: [(&CudaStorage, &Layout); 3]) -> Result<(CudaStorage, Shape)>;
}

/// An op of this crate as candle applies it: `tensor.apply_op1_no_bwd(&CudaOnly(op))`.
pub struct CudaOnly<T>(pub T);

fn refuse(name: &str) -> Result<(CpuStorage, Shape)> {
    candle_core::bail!("{name} runs on CUDA only: on the CPU its caller runs the reference")
}

impl<T: CudaOp1> CustomOp1 for CudaOnly<T> {
    fn name(&self) -> &'static str {
        <T as CudaOp1>::NAME
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        refuse(<T as CudaOp1>::NAME)
    }

    fn cuda_fwd(&self, a: &CudaStorage, al: &Layout) -> Result<(CudaStorage, Shape)> {
        CudaOp1::cuda_fwd(&self.0, a, al)
    }
}

impl<T: CudaOp2> CustomOp2 for CudaOnly<T> {
    fn name(&self) -> &'static str {
        <T as CudaOp2>::NAME
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        refuse(<T as CudaOp2>::NAME)
    }

    fn cuda_fwd(&self, a: &CudaStorage, al: &Layout, b: &CudaStorage, bl: &Layout) -> Result<(CudaStorage, Shape)> {
        CudaOp2::cuda_fwd(&self.0, a, al, b, bl)
    }
}

impl<T: CudaOp3> CustomOp3 for CudaOnly<T> {
    fn name(&self) -> &'static str {
        <T as CudaOp3>::NAME
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        refuse(<T as CudaOp3>::NAME)
    }

    fn cuda_fwd(
        &self,
        a: &CudaStorage,
        al: &Layout,
        b: &CudaStorage,
        bl: &Layout,
        c: &CudaStorage,
        cl: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        CudaOp3::cuda_fwd(&self.0, [(a, al), (b, bl), (c, cl)])
    }
}
