//! `--manifests DIR`: Service and EndpointSlice YAML (or JSON) files,
//! reloaded when they change.
//!
//! A `v1` `Node` document named like this node stands for this node's Node
//! object, as the API source watches it: its `topology.kubernetes.io/zone`
//! label is the node's zone for topology hints, its addresses give the
//! node IPs when `--node-ip` is not set (see [`ManifestDir::node`]).
//!
//! Every `.yaml`, `.yml` and `.json` file in the directory is read as a
//! stream of documents, any number of them, lists included ([`parse`]).
//! Documents of other kinds (a Deployment in the same file, say) are
//! skipped. A file that cannot be parsed keeps what it contributed before,
//! so a half-saved edit never takes Services down; it is reported once per
//! change, naming the file. Only files whose length, modification time or
//! inode changed are read again, several at a time.

mod block;
mod direct;
mod parse;

use std::{
    collections::BTreeMap,
    os::unix::fs::MetadataExt,
    path::{Path, PathBuf},
    sync::atomic::{AtomicUsize, Ordering},
    time::{Duration, Instant, SystemTime},
};

use anyhow::{Context, Result};
use k8s_openapi::api::{
    core::v1::{Node, Service},
    discovery::v1::EndpointSlice,
};
use tokio::sync::mpsc;
use tracing::{error, info};

use self::parse::{FileError, FileObjects, Format};
use super::{SourceEvent, Update};
use crate::model::Problem;

/// What identifies a version of a file without reading it: when it
/// changes, the file is read again.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Stamp {
    len: u64,
    modified: Option<SystemTime>,
    /// An editor that saves by renaming a new file over the old one.
    inode: u64,
}

impl Stamp {
    fn of(path: &Path) -> std::io::Result<Self> {
        let meta = std::fs::metadata(path)?;
        Ok(Self {
            len: meta.len(),
            modified: meta.modified().ok(),
            inode: meta.ino(),
        })
    }
}

/// One manifest file as last read.
struct LoadedFile {
    /// The version read (also when it could not be used).
    stamp: Stamp,
    /// Its Services and EndpointSlices (from that version, or from the last
    /// one that could be used) as LZ4-compressed JSON: the next reading
    /// takes them from here when the file did not change. As JSON they
    /// take a fraction of the memory they take as objects (keeping objects
    /// and cloning them into every reading cost the agent ~35 MiB more at
    /// 10,000 Services x 10 endpoints), compressed a tenth of that again
    /// (13.5 MB of JSON there), and they read back faster than YAML parses.
    cached: Vec<u8>,
    /// Its Nodes (a few), as objects.
    nodes: Vec<Node>,
}

/// A file's Services and EndpointSlices, as cached.
type CachedObjects = (Vec<Service>, Vec<EndpointSlice>);

/// A complete reading of the directory: every Service, every EndpointSlice,
/// and what could not be used.
pub type Reading = (Vec<Service>, Vec<EndpointSlice>, Vec<Problem>);

/// How often the directory is checked for changes.
pub const POLL_INTERVAL: Duration = Duration::from_millis(200);

pub struct ManifestDir {
    dir: PathBuf,
    files: BTreeMap<PathBuf, LoadedFile>,
    /// Whether a reading was made yet (the first one is always sent).
    read_once: bool,
    /// This node's name: the Node document it looks for.
    node_name: Option<String>,
}

impl ManifestDir {
    pub fn new(dir: &Path) -> Result<Self> {
        if !dir.is_dir() {
            anyhow::bail!(
                "manifest directory {} does not exist or is not a directory",
                dir.display()
            );
        }
        Ok(Self {
            dir: dir.to_owned(),
            files: BTreeMap::new(),
            read_once: false,
            node_name: None,
        })
    }

    /// Looks for the Node document named `name` (this node's).
    #[must_use]
    pub fn for_node(mut self, name: &str) -> Self {
        self.node_name = Some(name.to_owned());
        self
    }

    /// This node's Node document as of the last reading, if there is one
    /// (the first of that name).
    pub fn node(&self) -> Option<&Node> {
        let name = self.node_name.as_deref()?;
        self.files
            .values()
            .flat_map(|f| &f.nodes)
            .find(|n| n.metadata.name.as_deref() == Some(name))
    }

    /// Every manifest file in the directory with its current stamp, in
    /// name order. A file that vanished between listing and stat is left
    /// out (it is gone).
    fn manifest_files(&self) -> Result<Vec<(PathBuf, Stamp, Format)>> {
        let mut files = Vec::new();
        for entry in std::fs::read_dir(&self.dir).with_context(|| format!("reading {}", self.dir.display()))? {
            let path = entry.with_context(|| format!("reading {}", self.dir.display()))?.path();
            let Some(format) = Format::of(&path) else { continue };
            if let Ok(stamp) = Stamp::of(&path)
                && path.is_file()
            {
                files.push((path, stamp, format));
            }
        }
        files.sort_by(|a, b| a.0.cmp(&b.0));
        Ok(files)
    }

    /// Reads the files that changed since the last call. Returns the
    /// complete lists of Services and EndpointSlices and the problems met,
    /// or `None` when no file changed.
    pub fn reload_if_changed(&mut self) -> Result<Option<Reading>> {
        let started = Instant::now();
        let current = self.manifest_files()?;
        let is_current = |path: &PathBuf| current.binary_search_by(|(p, _, _)| p.cmp(path)).is_ok();
        let removed = self.files.keys().any(|path| !is_current(path));
        let changed: Vec<(PathBuf, Stamp, Format)> = current
            .iter()
            .filter(|(path, stamp, _)| self.files.get(path).is_none_or(|f| f.stamp != *stamp))
            .cloned()
            .collect();
        if self.read_once && changed.is_empty() && !removed {
            return Ok(None);
        }
        self.read_once = true;
        let mut problems = Vec::new();
        // The objects of the files read now go to the reading as they are.
        let mut fresh = Vec::new();
        for ((path, stamp, _), parsed) in changed.iter().zip(read_files(&changed)) {
            match parsed {
                Ok((objects, found)) => {
                    problems.extend(found);
                    fresh.push((path.clone(), *stamp, objects));
                }
                Err(e) => {
                    let file = path.display().to_string();
                    error!(file, error = %e, "manifest file not used; keeping what it contributed before");
                    problems.push(Problem::new(&file, e.to_string()));
                    // Keep the last good contents of a file that broke; this
                    // version is not read again until it changes.
                    let previous = self.files.remove(path).unwrap_or_else(|| LoadedFile {
                        stamp: *stamp,
                        cached: serialize_objects(&[], &[]),
                        nodes: Vec::new(),
                    });
                    self.files.insert(
                        path.clone(),
                        LoadedFile {
                            stamp: *stamp,
                            ..previous
                        },
                    );
                }
            }
        }
        self.files.retain(|path, _| is_current(path));
        let reading = self.reading(fresh, problems);
        info!(
            files = self.files.len(),
            read = changed.len(),
            services = reading.0.len(),
            slices = reading.1.len(),
            took_ms = started.elapsed().as_secs_f64() * 1e3,
            "manifests read"
        );
        Ok(Some(reading))
    }

    /// Every file's objects together, in file order: those of `read_now`
    /// (which are cached for the next time) as they are, the others from
    /// the cache.
    fn reading(&mut self, read_now: Vec<(PathBuf, Stamp, FileObjects)>, mut problems: Vec<Problem>) -> Reading {
        let caches = parallel_map(&read_now, |(_, _, o)| serialize_objects(&o.services, &o.slices));
        let mut fresh: BTreeMap<PathBuf, CachedObjects> = BTreeMap::new();
        for ((path, stamp, objects), cached) in read_now.into_iter().zip(caches) {
            let loaded = LoadedFile {
                stamp,
                cached,
                nodes: objects.nodes,
            };
            self.files.insert(path.clone(), loaded);
            fresh.insert(path, (objects.services, objects.slices));
        }
        let unchanged: Vec<&LoadedFile> = self
            .files
            .iter()
            .filter(|(path, _)| !fresh.contains_key(*path))
            .map(|(_, file)| file)
            .collect();
        let mut decoded = parallel_map(&unchanged, |file| deserialize_objects(&file.cached)).into_iter();
        let (mut services, mut slices) = (Vec::new(), Vec::new());
        for path in self.files.keys() {
            let (file_services, file_slices) = match fresh.remove(path) {
                Some(objects) => objects,
                None => match decoded.next() {
                    Some(Ok(objects)) => objects,
                    // Not expected: the cache holds what serde_json wrote.
                    Some(Err(e)) => {
                        problems.push(Problem::new(
                            &path.display().to_string(),
                            format!("cache unreadable: {e}"),
                        ));
                        continue;
                    }
                    None => continue,
                },
            };
            services.extend(file_services);
            slices.extend(file_slices);
        }
        (services, slices, problems)
    }

    /// Polls the directory and sends a full snapshot whenever it changes,
    /// starting with the first one, until the receiver goes away. A
    /// reading made before (for this node's Node, see [`Self::node`]) is
    /// not read again: the first snapshot comes from its cache.
    pub fn spawn(mut self, events: mpsc::Sender<SourceEvent>) {
        self.read_once = false;
        tokio::spawn(async move {
            loop {
                // Parsing a large directory takes a while: not on a worker
                // the runtime counts on. A blocking task, not
                // `block_in_place`: a reload that ends while the runtime
                // shuts down must not come back to poll this task's timer
                // (tokio panics: "the context is being shut down").
                let reloaded = tokio::task::spawn_blocking(move || {
                    let result = self.reload_if_changed();
                    (self, result)
                })
                .await;
                let (this, result) = match reloaded {
                    Ok(done) => done,
                    Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
                    Err(_) => return, // cancelled: the runtime is shutting down
                };
                self = this;
                match result {
                    Ok(Some((services, slices, problems))) => {
                        let node: Vec<Node> = self.node().cloned().into_iter().collect();
                        let sent = async {
                            if !problems.is_empty() {
                                events.send(SourceEvent::Problems(problems)).await?;
                            }
                            // The zone first, so the first sync already uses it.
                            events.send(SourceEvent::Node(Update::Replace(node))).await?;
                            events.send(SourceEvent::Services(Update::Replace(services))).await?;
                            events.send(SourceEvent::Slices(Update::Replace(slices))).await
                        };
                        if sent.await.is_err() {
                            return;
                        }
                    }
                    Ok(None) => {}
                    Err(e) => {
                        let problem = Problem::new(&self.dir.display().to_string(), format!("{e:#}"));
                        if events.send(SourceEvent::Problems(vec![problem])).await.is_err() {
                            return;
                        }
                    }
                }
                tokio::time::sleep(POLL_INTERVAL).await;
            }
        });
    }
}

/// Services and EndpointSlices as [`LoadedFile::cached`] keeps them.
fn serialize_objects(services: &[Service], slices: &[EndpointSlice]) -> Vec<u8> {
    // Serializing objects that were just deserialized cannot fail: they
    // hold no maps with non-string keys and no failing Serialize impls.
    let json = serde_json::to_vec(&(services, slices)).unwrap_or_default();
    // Kept for as long as the file does not change: not the growth room.
    let mut compressed = lz4_flex::compress_prepend_size(&json);
    compressed.shrink_to_fit();
    compressed
}

/// Why a cache did not read back (not expected: it holds what
/// [`serialize_objects`] wrote).
#[derive(Debug, thiserror::Error)]
enum CacheError {
    #[error("cannot decompress: {0}")]
    Lz4(#[from] lz4_flex::block::DecompressError),
    #[error("not the JSON written: {0}")]
    Json(#[from] serde_json::Error),
}

/// The objects of a [`LoadedFile::cached`].
fn deserialize_objects(cached: &[u8]) -> Result<CachedObjects, CacheError> {
    let json = lz4_flex::decompress_size_prepended(cached)?;
    Ok(serde_json::from_slice(&json)?)
}

/// What one file gave: its objects and the documents skipped, or why it
/// cannot be used.
type Parsed = Result<(FileObjects, Vec<Problem>), FileError>;

/// Reads and parses `files`; the results in the same order. The work is
/// spread over the CPUs document by document (a directory of one large
/// file parses as fast as one of many small files); JSON, parsed many
/// times faster, goes file by file.
fn read_files(files: &[(PathBuf, Stamp, Format)]) -> Vec<Parsed> {
    let names: Vec<String> = files.iter().map(|(path, _, _)| path.display().to_string()).collect();
    let mut texts = Vec::with_capacity(files.len());
    let mut results: Vec<Parsed> = Vec::with_capacity(files.len());
    for (path, _, _) in files {
        match std::fs::read_to_string(path) {
            Ok(text) => {
                texts.push(Some(text));
                results.push(Ok(Default::default()));
            }
            Err(e) => {
                texts.push(None);
                results.push(Err(e.into()));
            }
        }
    }
    let mut units = Vec::new();
    for (file, (text, (_, _, format))) in texts.iter().zip(files).enumerate() {
        let (Some(text), name) = (text, &names[file]) else {
            continue;
        };
        match format {
            Format::Yaml => units.extend(
                parse::yaml_documents(text)
                    .into_iter()
                    .enumerate()
                    .map(|(index, doc)| Unit::YamlDocument { file, name, index, doc }),
            ),
            Format::Json => units.push(Unit::Json { file, name, text }),
        }
    }
    let mut broken_yaml = vec![false; files.len()];
    for (unit, parsed) in units.iter().zip(parallel_map(&units, Unit::parse)) {
        match (unit, parsed) {
            (_, Ok((objects, problems))) => {
                if let Ok((all, found)) = &mut results[unit.file()] {
                    all.append(objects);
                    found.extend(problems);
                }
            }
            (Unit::YamlDocument { file, .. }, Err(_)) => broken_yaml[*file] = true,
            (Unit::Json { file, .. }, Err(e)) => results[*file] = Err(e),
        }
    }
    // A document that did not parse alone: the whole file again, for the
    // stream's own verdict and line numbers.
    for (file, broken) in broken_yaml.into_iter().enumerate() {
        if let (true, Some(text)) = (broken, &texts[file]) {
            results[file] = parse::parse(text, Format::Yaml, &names[file]);
        }
    }
    results
}

/// A piece of parsing work.
enum Unit<'a> {
    /// Document `index` of a YAML file.
    YamlDocument {
        file: usize,
        name: &'a str,
        index: usize,
        doc: &'a str,
    },
    /// A whole JSON file.
    Json { file: usize, name: &'a str, text: &'a str },
}

impl Unit<'_> {
    fn file(&self) -> usize {
        match self {
            Unit::YamlDocument { file, .. } | Unit::Json { file, .. } => *file,
        }
    }

    fn parse(&self) -> Parsed {
        match self {
            Unit::YamlDocument { name, index, doc, .. } => Ok(parse::parse_yaml_document(doc, name, *index)?),
            Unit::Json { name, text, .. } => parse::parse(text, Format::Json, name),
        }
    }
}

/// `f` of every item, on as many threads as there are CPUs; the results in
/// the items' order.
fn parallel_map<T: Sync, R: Send>(items: &[T], f: impl Fn(&T) -> R + Sync) -> Vec<R> {
    let workers = std::thread::available_parallelism()
        .map_or(1, std::num::NonZero::get)
        .min(items.len());
    if workers <= 1 {
        return items.iter().map(f).collect();
    }
    // Each worker takes the next item when it is done with one: items
    // differ in size.
    let next = AtomicUsize::new(0);
    let mut results: Vec<(usize, R)> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..workers)
            .map(|_| {
                scope.spawn(|| {
                    let mut done = Vec::new();
                    loop {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        let Some(item) = items.get(i) else { break done };
                        done.push((i, f(item)));
                    }
                })
            })
            .collect();
        handles
            .into_iter()
            .flat_map(|h| h.join().unwrap_or_else(|panic| std::panic::resume_unwind(panic)))
            .collect()
    });
    results.sort_unstable_by_key(|(i, _)| *i);
    results.into_iter().map(|(_, r)| r).collect()
}

#[cfg(test)]
mod tests;
