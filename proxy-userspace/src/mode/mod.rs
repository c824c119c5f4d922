//! Data-plane modes. Each one programs the kernel from the same model.

pub mod ebpf;
