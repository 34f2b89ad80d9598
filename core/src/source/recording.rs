//! Tests: a memory source that copies what it reads, as local files and the browser do (it lends
//! nothing, and whole reads are not cheap), and records each read and each hint.

use std::borrow::Cow;
use std::cell::RefCell;

use super::{MemorySource, Source, SourceError};

pub(crate) struct Recording {
    inner: MemorySource,
    /// `(name, offset, len)` of each read, in order.
    pub(crate) reads: RefCell<Vec<(String, u64, u64)>>,
    /// The ranges of each [`Source::will_read`] call, in order.
    pub(crate) hinted: RefCell<Vec<Vec<(String, u64, u64)>>>,
}

impl Recording {
    pub(crate) fn new(inner: MemorySource) -> Self {
        Recording {
            inner,
            reads: RefCell::default(),
            hinted: RefCell::default(),
        }
    }
}

impl Source for Recording {
    fn names(&self) -> Vec<String> {
        self.inner.names()
    }
    fn size(&self, name: &str) -> Result<u64, SourceError> {
        self.inner.size(name)
    }
    fn read_range(&self, name: &str, offset: u64, len: u64) -> Result<Cow<'_, [u8]>, SourceError> {
        self.reads.borrow_mut().push((name.to_owned(), offset, len));
        Ok(Cow::Owned(
            self.inner.read_range(name, offset, len)?.into_owned(),
        ))
    }
    fn will_read(&self, reads: &[(&str, u64, u64)]) {
        self.hinted.borrow_mut().push(
            reads
                .iter()
                .map(|&(n, o, l)| (n.to_owned(), o, l))
                .collect(),
        );
    }
}
