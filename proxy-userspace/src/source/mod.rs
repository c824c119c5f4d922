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
///
/// A complete list (initial list, relist, reload) is either one `Replace`,
/// or `ListBegin`, parts as they arrive (`Listed`), and a `Replace` with
/// the rest: a large list is taken in while the source still receives it.
#[derive(Clone, Debug)]
pub enum Update<K> {
    Apply(K),
    Delete(K),
    /// A list begins; a list begun before and not ended is abandoned.
    ListBegin,
    /// Objects of the list in progress: they exist now.
    Listed(Vec<K>),
    /// The end of a list, with its last objects (or all of them if no
    /// `ListBegin` came first): anything not in the list is gone. The first
    /// one marks the kind as synced.
    Replace(Vec<K>),
}

impl<K> Update<K> {
    /// How many objects the update carries.
    pub fn object_count(&self) -> usize {
        match self {
            Update::Apply(_) | Update::Delete(_) => 1,
            Update::ListBegin => 0,
            Update::Listed(objects) | Update::Replace(objects) => objects.len(),
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
