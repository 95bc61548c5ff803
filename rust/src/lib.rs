//! # ddtree
//!
//! The CPU side of DDTree speculative decoding: turn a DFlash drafter's
//! per-position top-K distributions into the tree of the most probable draft
//! prefixes ([`build`]), compile it into what a tree-verification forward pass
//! needs ([`compile`]), walk the target's verdict to find the accepted path
//! ([`accept`]), all batched over a decoding step's requests ([`batch`]), and laid out as an engine's flat
//! step needs them, in caller-owned buffers ([`layout`]).
//!
//! This crate knows nothing of Python; the extension module lives in
//! `python/` behind the `python` feature.

pub mod accept;
pub mod batch;
pub mod build;
pub mod compile;
pub mod error;
pub mod layout;
pub mod limits;
pub mod tree;

#[cfg(feature = "python")]
mod python;

pub use accept::TreeWalker;
pub use batch::{accept_trees, build_trees, compile_trees, BatchDistribution, Executor, TreeBatch};
pub use build::TreeBuilder;
pub use compile::{kv_moves, words_per_row, CompiledTree};
pub use error::{DdtreeError, Result};
pub use layout::{
    acceptance_layout_into, verify_layout_into, AcceptanceLayout, NodeArrays, StepPlacement,
    VerifyLayout,
};
pub use tree::{DraftDistribution, TokenId, Tree, TreeView};
