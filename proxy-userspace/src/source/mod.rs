//! Sources of Services and EndpointSlices. Sources only report what they
//! see as [`SourceEvent`]s; the agent loop owns the model.

pub mod kube;
pub mod manifest;
pub mod node;
pub mod request_counter;

use k8s_openapi::api::{
    core::v1::{Node, Service},
    discovery::v1::EndpointSlice,
};

use crate::model::Problem;

/// A change to one kind of object.
#[derive(Clone, Debug)]
pub enum Update<K> {
    Apply(K),
    Delete(K),
    /// The complete current list (initial list, relist, reload): anything
    /// not in it is gone. The first one marks the kind as synced.
    Replace(Vec<K>),
}

impl<K> Update<K> {
    /// How many objects the update carries.
    pub fn object_count(&self) -> usize {
        match self {
            Update::Apply(_) | Update::Delete(_) => 1,
            Update::Replace(all) => all.len(),
        }
    }
}

// The variants differ in size by a Service's inline fields; boxing them
// would add an allocation per event for nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Clone, Debug)]
pub enum SourceEvent {
    Services(Update<Service>),
    Slices(Update<EndpointSlice>),
    /// This node's own Node object (for the health check's deletion rule).
    Node(Update<Node>),
    /// Input the source could not use at all (an unreadable file, a
    /// document that is not valid YAML): logged and counted.
    Problems(Vec<Problem>),
}
