//! The file tier's cache: a fixed number of slots of host memory, each holding one block of a
//! context file's rows (a head's run of [`super::BLOCK_ROWS`] consecutive positions of one K or
//! V section), found by the block's key, evicted by CLOCK.
//!
//! Why blocks and CLOCK: a sparse step picks rows that cluster (a window, a search's leaf
//! blocks, heavy hitters) and mostly the rows the step before picked, so caching blocks keeps
//! what the method keeps coming back to, and a block is a read the disk serves at its rate (a
//! 128-byte row alone would cost a 4 KiB read). CLOCK approximates least-recently-used with one
//! bit a slot and no list to reorder on every hit. A slot used by the gather in flight is never
//! evicted by that gather ([`BlockCache::take`]): its rows are copied out after every miss is
//! read.
//!
//! The slots are shared with the device's gathers ([`SharedHost`]: registered in place on a
//! GPU), followed by a region of fp8 scales, a slot's beside it: a step's picks are then
//! gathered from the slots by the device over the host link and widened there, as the host tier
//! gathers from a context file's mapping, instead of widened by the CPU and copied as f32 (where
//! the device cannot register the memory, the CPU widens every gather). A slot is written only
//! once the device has finished every gather that may read it ([`BlockCache::quiesce`]): the
//! device's stream is waited for only when a slot being refilled was read by a device gather
//! queued since the last wait — with a cache of a million slots, an evicted block was mostly last
//! used many gathers ago, and a wait per gather would drain the forward pass's queue at every
//! layer. (Registered memory is read-only *to the device*; the host writes it between its reads.)

use std::collections::HashMap;
use std::sync::Arc;

use candle_core::Device;
use folio_kernels::select::SharedHost;
use folio_runtime::host_budget::{Held, Hold};

/// No key: a slot never filled.
const EMPTY: u64 = u64::MAX;

/// Slots of `slot_bytes` each; see the module docs.
pub(super) struct BlockCache {
    slot_bytes: usize,
    /// Bytes of a slot's scales in the region after the slots.
    scale_bytes: usize,
    /// The slots, then the scales, held in the host budget and shared with the device.
    mem: Arc<SharedHost>,
    /// Where `mem` lies, for [`BlockCache::write`].
    base: Base,
    device: Device,
    /// Whether the device gathers from the memory (registered with it, or the CPU's own).
    on_device: bool,
    /// Every gather numbered below `synced` has finished on the device; the latest gather that
    /// queued a device read of a slot refilled since; per slot, the latest gather that queued
    /// a device read of it.
    synced: u64,
    refilled_use: u64,
    device_use: Vec<u64>,
    map: HashMap<u64, u32>,
    keys: Vec<u64>,
    /// CLOCK's bit: used since the hand last passed.
    referenced: Vec<bool>,
    /// The gather that last used the slot (a slot of the gather in flight is not evicted).
    used_by: Vec<u64>,
    hand: usize,
    /// The gather that found every slot its own (0: none): its later misses pass at once. No
    /// slot becomes free for it again (another gather, a read-ahead's, may take its slots but
    /// hands none back), and without this
    /// every further miss of a gather larger than the cache turned the clock twice round (a
    /// million-row pick through a 64 MiB cache took seconds a step in these scans alone).
    exhausted: u64,
}

/// A block the cache was asked for: where its bytes are, or that it must be read.
pub(super) enum Found {
    /// In this slot already.
    Hit(usize),
    /// Not cached: read it into this slot.
    Fill(usize),
    /// Not cached and no slot free of the gather in flight: read it to a buffer of its own.
    Pass,
}

/// The cache memory's address: written through only by [`BlockCache::write`], under the
/// `&mut` of the cache (the tier's lock).
struct Base(*mut u8);

// SAFETY: the address is of memory the cache owns (through `mem`) for as long as it lives; it
// is written only through `&mut BlockCache`, so sharing `&BlockCache` shares no writer.
unsafe impl Send for Base {}
unsafe impl Sync for Base {}

impl BlockCache {
    /// `slots` slots of `slot_bytes` and `scale_bytes` of scales each in host memory held by
    /// `hold`, shared with `device`.
    pub(super) fn new(
        slots: usize,
        (slot_bytes, scale_bytes): (usize, usize),
        hold: Hold,
        device: &Device,
    ) -> candle_core::Result<Self> {
        let mut map = folio_runtime::host_memory::anon_huge(slots * (slot_bytes + scale_bytes))?;
        let base = Base(map.as_mut_ptr());
        let owner = Arc::new(Held::new(map, hold));
        let (mem, on_device) = match SharedHost::new(device, owner.clone()) {
            Ok(mem) => (mem, true),
            Err(e) => {
                // (A platform that refuses to register it: the CPU widens what the steps pick.)
                tracing::warn!(error = %e, "the file tier's cache is not shared with the device");
                (SharedHost::new(&Device::Cpu, owner)?, false)
            }
        };
        Ok(Self {
            slot_bytes,
            scale_bytes,
            mem,
            base,
            device: device.clone(),
            on_device,
            synced: 1,
            refilled_use: 0,
            device_use: vec![0; slots],
            map: HashMap::with_capacity(slots),
            keys: vec![EMPTY; slots],
            referenced: vec![false; slots],
            used_by: vec![0; slots],
            hand: 0,
            exhausted: 0,
        })
    }

    /// Block `key`'s slot for gather number `gather` (gathers are numbered from 1), a slot to
    /// fill when it is not cached (evicting by CLOCK a block no slot of this gather holds), or
    /// [`Found::Pass`] when every slot is this gather's.
    pub(super) fn take(&mut self, key: u64, gather: u64) -> Found {
        if let Some(&slot) = self.map.get(&key) {
            let slot = slot as usize;
            self.referenced[slot] = true;
            self.used_by[slot] = gather;
            return Found::Hit(slot);
        }
        if self.exhausted == gather {
            return Found::Pass;
        }
        let Some(slot) = self.victim(gather) else {
            self.exhausted = gather;
            return Found::Pass;
        };
        if self.keys[slot] != EMPTY {
            self.map.remove(&self.keys[slot]);
        }
        self.refilled_use = self.refilled_use.max(self.device_use[slot]);
        self.keys[slot] = key;
        self.map.insert(key, slot as u32);
        self.referenced[slot] = true;
        self.used_by[slot] = gather;
        Found::Fill(slot)
    }

    /// Whether block `key` is cached, marking it used (CLOCK keeps it a turn longer).
    pub(super) fn touch(&mut self, key: u64) -> bool {
        match self.map.get(&key) {
            Some(&slot) => {
                self.referenced[slot as usize] = true;
                true
            }
            None => false,
        }
    }

    /// Block `key`'s slot when it is cached (a scan's lookup: it takes no slot).
    pub(super) fn find(&mut self, key: u64, gather: u64) -> Option<usize> {
        let slot = *self.map.get(&key)? as usize;
        self.used_by[slot] = gather;
        Some(slot)
    }

    /// CLOCK: the first slot from the hand on whose bit is clear, clearing bits on the way;
    /// slots of gather `gather` are skipped. Two turns find one if any slot is not the gather's.
    fn victim(&mut self, gather: u64) -> Option<usize> {
        let n = self.keys.len();
        for _ in 0..2 * n {
            let slot = self.hand;
            self.hand = (self.hand + 1) % n;
            if self.used_by[slot] == gather {
                continue;
            }
            if self.referenced[slot] {
                self.referenced[slot] = false;
            } else {
                return Some(slot);
            }
        }
        None
    }

    /// Forgets every block (after a gather that took slots and never filled them).
    pub(super) fn clear(&mut self) {
        self.map.clear();
        self.keys.fill(EMPTY);
        self.referenced.fill(false);
    }

    /// Forgets a block whose read failed (its slot holds no rows).
    pub(super) fn forget(&mut self, slot: usize) {
        if self.keys[slot] != EMPTY {
            self.map.remove(&self.keys[slot]);
            self.keys[slot] = EMPTY;
        }
    }

    pub(super) fn slot_bytes(&self) -> usize {
        self.slot_bytes
    }

    /// The memory the device gathers from: the slots, then their scales.
    pub(super) fn shared(&self) -> &Arc<SharedHost> {
        &self.mem
    }

    pub(super) fn slot(&self, slot: usize) -> &[u8] {
        &self.mem.bytes()[slot * self.slot_bytes..(slot + 1) * self.slot_bytes]
    }

    /// Whether the device gathers from the slots (else the CPU widens every gather).
    pub(super) fn on_device(&self) -> bool {
        self.on_device
    }

    /// Before gather `gather` writes the slots it took: waits for the device to finish the
    /// gathers queued before it when one of them may read a slot being refilled.
    pub(super) fn quiesce(&mut self, gather: u64) -> candle_core::Result<()> {
        if self.on_device && self.refilled_use >= self.synced {
            self.device.synchronize()?;
            self.synced = gather;
        }
        Ok(())
    }

    /// Records that gather `gather` queued a device read of `slots`.
    pub(super) fn queued_on_device(&mut self, slots: impl IntoIterator<Item = usize>, gather: u64) {
        slots.into_iter().for_each(|slot| self.device_use[slot] = gather);
    }

    /// Fills `slot` with a block's `rows` and (fp8) `scales` (at most a slot's bytes each; the
    /// scales stored little-endian), after [`Self::quiesce`] for the gather that took it.
    pub(super) fn write(&mut self, slot: usize, rows: &[u8], scales: &[f32]) {
        let scale_bytes = std::mem::size_of_val(scales);
        assert!(rows.len() <= self.slot_bytes && scale_bytes <= self.scale_bytes && slot < self.keys.len());
        let scales_at = self.keys.len() * self.slot_bytes + slot * self.scale_bytes;
        // SAFETY: both ranges lie within the cache's memory (checked above), which lives as
        // long as `self`; `&mut self` excludes every other writer and every CPU reader of it
        // (readers borrow `self`), and every gather queued that used the slot before has
        // finished (the caller's `quiesce`).
        unsafe {
            std::ptr::copy_nonoverlapping(rows.as_ptr(), self.base.0.add(slot * self.slot_bytes), rows.len());
            let to = self.base.0.add(scales_at);
            for (i, s) in scales.iter().enumerate() {
                std::ptr::copy_nonoverlapping(s.to_le_bytes().as_ptr(), to.add(4 * i), 4);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cache(slots: usize) -> BlockCache {
        let hold = folio_runtime::host_budget::hold(0, "a test cache").unwrap();
        BlockCache::new(slots, (64, 8), hold, &Device::Cpu).unwrap()
    }

    /// CLOCK's rules on random keys: no slot of the gather in flight evicted, a full gather
    /// passes, what is used again is kept, the map and the keys agree.
    #[test]
    fn clock_keeps_what_is_used_and_never_evicts_the_gathers_own() {
        use rand::{Rng, SeedableRng};
        let seed = rand::random();
        println!("seed {seed}");
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let mut c = cache(8);
        // Gather 1 fills slots 0..8; a ninth block of the same gather passes.
        for key in 0..8 {
            assert!(matches!(c.take(key, 1), Found::Fill(s) if s == key as usize));
        }
        assert!(matches!(c.take(100, 1), Found::Pass));
        // Its further misses pass at once, without the clock's two turns: not even a slot
        // handed back behind its back (which nothing does) is looked for. Its hits are found.
        c.used_by[6] = 0;
        assert!(matches!(c.take(101, 1), Found::Pass), "a gather that filled the cache scanned it again");
        c.used_by[6] = 1;
        assert!(matches!(c.take(3, 1), Found::Hit(3)));
        // Gather 2 uses keys 0 and 1 again (hits) and a new key, which evicts another block.
        for key in [0, 1, 0] {
            assert!(matches!(c.take(key, 2), Found::Hit(_)));
        }
        assert!(matches!(c.take(50, 2), Found::Fill(_)));
        assert!(c.map.contains_key(&0) && c.map.contains_key(&1));
        // Random gathers: a block taken stays found within its gather; the map and the keys agree.
        for gather in 3..200 {
            let keys: Vec<u64> = (0..rng.random_range(1..12)).map(|_| rng.random_range(0..20)).collect();
            let mut mine = Vec::new();
            for &key in &keys {
                match c.take(key, gather) {
                    Found::Hit(s) | Found::Fill(s) => mine.push((key, s)),
                    Found::Pass => assert!(c.used_by.iter().all(|&g| g == gather)),
                }
            }
            for (key, s) in mine {
                assert_eq!((c.map[&key] as usize, c.keys[s]), (s, key), "gather {gather}");
            }
            assert_eq!(c.map.len(), c.keys.iter().filter(|&&k| k != EMPTY).count());
        }
        // A scan finds what is cached and takes nothing.
        let cached = c.keys[5];
        assert_eq!(c.find(cached, 2000), Some(5));
        assert_eq!(c.find(1000, 2000), None);
        assert!(!c.map.contains_key(&1000));
        c.forget(3);
        assert_eq!(c.keys[3], EMPTY);
        c.write(3, &[7; 64], &[f32::from_le_bytes([9; 4]); 2]);
        assert_eq!(c.slot(3), &[7; 64]);
        assert_eq!(&c.shared().bytes()[8 * 64 + 3 * 8..8 * 64 + 4 * 8], &[9; 8]);
        c.clear();
        assert!(c.map.is_empty() && c.keys.iter().all(|&k| k == EMPTY));
        assert!(matches!(c.take(cached, 3000), Found::Fill(_)));
    }

    /// The device is waited for before a refill only when a device gather queued since the
    /// last wait read the slot being refilled.
    #[test]
    fn a_refill_waits_only_for_device_reads_of_its_slot() {
        let mut c = cache(2);
        assert!(matches!(c.take(10, 1), Found::Fill(0)) && matches!(c.take(11, 1), Found::Fill(1)));
        c.quiesce(1).unwrap();
        assert_eq!(c.synced, 1, "empty slots were read by no one");
        c.queued_on_device([0], 2);
        // Gather 3 refills slot 1 (read only by the CPU): no wait.
        c.referenced.fill(false);
        c.hand = 1;
        assert!(matches!(c.take(12, 3), Found::Fill(1)));
        c.quiesce(3).unwrap();
        assert_eq!(c.synced, 1);
        // Gather 4 refills slot 0, which gather 2 read on the device: a wait, then gathers
        // below 4 are done.
        c.referenced.fill(false);
        c.hand = 0;
        assert!(matches!(c.take(13, 4), Found::Fill(0)));
        c.quiesce(4).unwrap();
        assert_eq!(c.synced, 4);
        // Refilled again by gather 5: gather 2's read is done by now.
        c.referenced.fill(false);
        c.hand = 0;
        assert!(matches!(c.take(14, 5), Found::Fill(0)));
        c.quiesce(5).unwrap();
        assert_eq!(c.synced, 4);
    }
}
