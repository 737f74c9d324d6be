//! A restricted pickle virtual machine for the subset of opcodes `torch.save`
//! writes. It never imports or calls anything: `GLOBAL`/`STACK_GLOBAL` are
//! resolved against a fixed allow-list into inert [`Global`] markers, and
//! `REDUCE` only "calls" the few of those that build containers or tensor
//! descriptions. Every length read from the input is checked against the
//! bytes remaining before anything is allocated, and the memo size, stack
//! depth, nesting depth and total work are bounded.

use std::collections::HashMap;
use std::rc::Rc;
use thiserror::Error;

/// Errors of the pickle VM. `offset` is the byte offset of the opcode.
#[derive(Debug, Error, Clone, PartialEq)]
pub enum PickleError {
    #[error("pickle truncated at offset {offset}: {what} needs {need} bytes, {have} left")]
    Truncated {
        offset: usize,
        what: &'static str,
        need: u64,
        have: usize,
    },
    #[error("pickle opcode 0x{opcode:02x} at offset {offset} is not supported")]
    UnsupportedOpcode { opcode: u8, offset: usize },
    #[error("pickle refers to global `{0}`, which is not on the allow-list (refusing to load)")]
    DisallowedGlobal(String),
    #[error("pickle malformed at offset {offset}: {msg}")]
    Malformed { offset: usize, msg: String },
    #[error("pickle limit exceeded at offset {offset}: {msg}")]
    Limit { offset: usize, msg: String },
    #[error("pickle ended without STOP")]
    NoStop,
}

/// Globals the reader recognises. None of them is ever executed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Global {
    OrderedDict,
    RebuildTensorV2,
    RebuildParameter,
    /// A typed storage class, e.g. `torch.BFloat16Storage`.
    Storage(StorageType),
    /// A dtype object such as `torch.bfloat16` (only ever used as a value).
    DType(StorageType),
}

/// The element type named by a storage class or dtype global.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StorageType {
    BFloat16,
    Half,
    Float,
    Int,
    /// Known to torch but not loadable here (double, int64, bool, ...).
    Unsupported(&'static str),
}

impl StorageType {
    pub fn name(self) -> &'static str {
        match self {
            StorageType::BFloat16 => "torch.BFloat16Storage",
            StorageType::Half => "torch.HalfStorage",
            StorageType::Float => "torch.FloatStorage",
            StorageType::Int => "torch.IntStorage",
            StorageType::Unsupported(n) => n,
        }
    }
}

/// Resolve `module.name` against the allow-list.
pub fn resolve_global(module: &str, name: &str) -> Result<Global, PickleError> {
    use StorageType as S;
    let g = match (module, name) {
        ("collections", "OrderedDict") => Global::OrderedDict,
        ("torch._utils", "_rebuild_tensor_v2") => Global::RebuildTensorV2,
        ("torch._utils", "_rebuild_parameter") => Global::RebuildParameter,
        ("torch", "BFloat16Storage") => Global::Storage(S::BFloat16),
        ("torch", "HalfStorage") => Global::Storage(S::Half),
        ("torch", "FloatStorage") => Global::Storage(S::Float),
        ("torch", "IntStorage") => Global::Storage(S::Int),
        ("torch", "bfloat16") => Global::DType(S::BFloat16),
        ("torch", "float16") | ("torch", "half") => Global::DType(S::Half),
        ("torch", "float32") | ("torch", "float") => Global::DType(S::Float),
        ("torch", "int32") => Global::DType(S::Int),
        ("torch", n) => {
            let known: &[&'static str] = &[
                "DoubleStorage",
                "LongStorage",
                "ShortStorage",
                "CharStorage",
                "ByteStorage",
                "BoolStorage",
                "ComplexFloatStorage",
                "ComplexDoubleStorage",
                "UntypedStorage",
                "QInt8Storage",
                "QUInt8Storage",
                "QInt32Storage",
                "QUInt4x2Storage",
                "QUInt2x4Storage",
            ];
            match known.iter().find(|k| **k == n) {
                Some(k) => Global::Storage(S::Unsupported(unsupported_name(k))),
                None => return Err(PickleError::DisallowedGlobal(format!("{module}.{name}"))),
            }
        }
        _ => return Err(PickleError::DisallowedGlobal(format!("{module}.{name}"))),
    };
    Ok(g)
}

fn unsupported_name(k: &str) -> &'static str {
    match k {
        "DoubleStorage" => "torch.DoubleStorage",
        "LongStorage" => "torch.LongStorage",
        "ShortStorage" => "torch.ShortStorage",
        "CharStorage" => "torch.CharStorage",
        "ByteStorage" => "torch.ByteStorage",
        "BoolStorage" => "torch.BoolStorage",
        "ComplexFloatStorage" => "torch.ComplexFloatStorage",
        "ComplexDoubleStorage" => "torch.ComplexDoubleStorage",
        "UntypedStorage" => "torch.UntypedStorage",
        "QInt8Storage" => "torch.QInt8Storage",
        "QUInt8Storage" => "torch.QUInt8Storage",
        "QInt32Storage" => "torch.QInt32Storage",
        "QUInt4x2Storage" => "torch.QUInt4x2Storage",
        _ => "torch.QUInt2x4Storage",
    }
}

/// A storage reference produced by `BINPERSID` on
/// `('storage', storage_type, key, location, numel)`.
#[derive(Debug, Clone, PartialEq)]
pub struct StorageRef {
    pub storage_type: StorageType,
    pub key: String,
    pub location: String,
    pub numel: u64,
}

/// A tensor description produced by `_rebuild_tensor_v2`.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorRef {
    pub storage: Rc<StorageRef>,
    pub storage_offset: u64,
    pub size: Vec<u64>,
    pub stride: Vec<u64>,
}

/// An unpickled value.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    None,
    Bool(bool),
    Int(i64),
    Float(f64),
    Str(Rc<str>),
    Bytes(Rc<[u8]>),
    Tuple(Rc<[Value]>, u32),
    List(Rc<Vec<Value>>, u32),
    /// Keys and values in insertion order (duplicates: last wins on lookup
    /// by the caller, like Python).
    Dict(Rc<Vec<(Value, Value)>>, u32),
    Global(Global),
    Storage(Rc<StorageRef>),
    Tensor(Rc<TensorRef>),
}

impl Value {
    /// Nesting depth (0 for scalars).
    fn depth(&self) -> u32 {
        match self {
            Value::Tuple(_, d) | Value::List(_, d) | Value::Dict(_, d) => *d,
            _ => 0,
        }
    }
    fn kind(&self) -> &'static str {
        match self {
            Value::None => "None",
            Value::Bool(_) => "bool",
            Value::Int(_) => "int",
            Value::Float(_) => "float",
            Value::Str(_) => "str",
            Value::Bytes(_) => "bytes",
            Value::Tuple(..) => "tuple",
            Value::List(..) => "list",
            Value::Dict(..) => "dict",
            Value::Global(_) => "global",
            Value::Storage(_) => "storage",
            Value::Tensor(_) => "tensor",
        }
    }
}

/// Resource limits of the VM.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub max_stack: usize,
    pub max_memo: usize,
    pub max_depth: u32,
    /// Total work units (roughly elements created or copied).
    pub max_work: u64,
    pub max_dims: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_stack: 1 << 20,
            max_memo: 1 << 20,
            max_depth: 100,
            max_work: 1 << 28,
            max_dims: 16,
        }
    }
}

enum Slot {
    Mark,
    V(Value),
}

struct Vm<'a> {
    data: &'a [u8],
    pos: usize,
    op_at: usize,
    stack: Vec<Slot>,
    memo: HashMap<u32, Value>,
    limits: Limits,
    work: u64,
}

/// Run the pickle in `data` and return the object left by `STOP`.
pub fn unpickle(data: &[u8]) -> Result<Value, PickleError> {
    unpickle_with_limits(data, Limits::default())
}

pub fn unpickle_with_limits(data: &[u8], limits: Limits) -> Result<Value, PickleError> {
    let mut vm = Vm {
        data,
        pos: 0,
        op_at: 0,
        stack: Vec::new(),
        memo: HashMap::new(),
        limits,
        work: 0,
    };
    // Nesting depth is limited, so the recursive drop of `Value` is bounded.
    vm.run()
}

impl<'a> Vm<'a> {
    fn malformed(&self, msg: impl Into<String>) -> PickleError {
        PickleError::Malformed {
            offset: self.op_at,
            msg: msg.into(),
        }
    }
    fn limit(&self, msg: impl Into<String>) -> PickleError {
        PickleError::Limit {
            offset: self.op_at,
            msg: msg.into(),
        }
    }
    fn charge(&mut self, units: u64) -> Result<(), PickleError> {
        self.work = self.work.saturating_add(units.saturating_add(1));
        if self.work > self.limits.max_work {
            return Err(self.limit(format!("more than {} work units", self.limits.max_work)));
        }
        Ok(())
    }

    fn take(&mut self, n: u64, what: &'static str) -> Result<&'a [u8], PickleError> {
        let have = self.data.len() - self.pos;
        match usize::try_from(n) {
            Ok(n) if n <= have => {
                let s = &self.data[self.pos..self.pos + n];
                self.pos += n;
                Ok(s)
            }
            _ => Err(PickleError::Truncated {
                offset: self.op_at,
                what,
                need: n,
                have,
            }),
        }
    }
    fn u8(&mut self, what: &'static str) -> Result<u8, PickleError> {
        Ok(self.take(1, what)?[0])
    }
    fn u16(&mut self, what: &'static str) -> Result<u16, PickleError> {
        let b = self.take(2, what)?;
        Ok(u16::from_le_bytes([b[0], b[1]]))
    }
    fn u32(&mut self, what: &'static str) -> Result<u32, PickleError> {
        let b = self.take(4, what)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }
    fn u64(&mut self, what: &'static str) -> Result<u64, PickleError> {
        let b = self.take(8, what)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(b);
        Ok(u64::from_le_bytes(a))
    }
    fn line(&mut self, what: &'static str) -> Result<&'a str, PickleError> {
        let rest = &self.data[self.pos..];
        let nl = rest
            .iter()
            .position(|&c| c == b'\n')
            .ok_or(PickleError::Truncated {
                offset: self.op_at,
                what,
                need: rest.len() as u64 + 1,
                have: rest.len(),
            })?;
        let s = std::str::from_utf8(&rest[..nl])
            .map_err(|_| self.malformed(format!("{what} is not UTF-8")))?;
        self.pos += nl + 1;
        Ok(s)
    }

    fn push(&mut self, v: Value) -> Result<(), PickleError> {
        if self.stack.len() >= self.limits.max_stack {
            return Err(self.limit(format!("stack deeper than {}", self.limits.max_stack)));
        }
        if v.depth() > self.limits.max_depth {
            return Err(self.limit(format!(
                "objects nested deeper than {}",
                self.limits.max_depth
            )));
        }
        self.charge(0)?;
        self.stack.push(Slot::V(v));
        Ok(())
    }
    fn push_mark(&mut self) -> Result<(), PickleError> {
        if self.stack.len() >= self.limits.max_stack {
            return Err(self.limit(format!("stack deeper than {}", self.limits.max_stack)));
        }
        self.stack.push(Slot::Mark);
        Ok(())
    }
    fn pop(&mut self) -> Result<Value, PickleError> {
        match self.stack.pop() {
            Some(Slot::V(v)) => Ok(v),
            Some(Slot::Mark) => Err(self.malformed("expected a value, found MARK")),
            None => Err(self.malformed("stack underflow")),
        }
    }
    fn top_mut(&mut self) -> Result<&mut Value, PickleError> {
        let at = self.op_at;
        match self.stack.last_mut() {
            Some(Slot::V(v)) => Ok(v),
            _ => Err(PickleError::Malformed {
                offset: at,
                msg: "expected a value on top of the stack".into(),
            }),
        }
    }
    /// Pop everything down to and including the topmost MARK.
    fn pop_to_mark(&mut self) -> Result<Vec<Value>, PickleError> {
        let at = self
            .stack
            .iter()
            .rposition(|s| matches!(s, Slot::Mark))
            .ok_or_else(|| self.malformed("no MARK on the stack"))?;
        let items: Vec<Value> = self
            .stack
            .drain(at + 1..)
            .map(|s| match s {
                Slot::V(v) => v,
                Slot::Mark => Value::None, // unreachable: `at` is the last mark
            })
            .collect();
        self.stack.pop();
        self.charge(items.len() as u64)?;
        Ok(items)
    }

    fn make_tuple(&self, items: Vec<Value>) -> Value {
        let d = items.iter().map(Value::depth).max().unwrap_or(0) + 1;
        Value::Tuple(items.into(), d)
    }

    fn memo_put(&mut self, idx: u32) -> Result<(), PickleError> {
        let v = match self.stack.last() {
            Some(Slot::V(v)) => v.clone(),
            _ => return Err(self.malformed("memo put with no value on the stack")),
        };
        if !self.memo.contains_key(&idx) && self.memo.len() >= self.limits.max_memo {
            return Err(self.limit(format!("memo larger than {}", self.limits.max_memo)));
        }
        self.charge(0)?;
        self.memo.insert(idx, v);
        Ok(())
    }
    fn memo_get(&mut self, idx: u32) -> Result<(), PickleError> {
        let v = self
            .memo
            .get(&idx)
            .cloned()
            .ok_or_else(|| self.malformed(format!("memo key {idx} not defined")))?;
        self.push(v)
    }

    fn str_value(&self, b: &[u8], what: &str) -> Result<Value, PickleError> {
        let s = std::str::from_utf8(b)
            .map_err(|_| self.malformed(format!("{what} is not valid UTF-8")))?;
        Ok(Value::Str(s.into()))
    }

    fn append_items(&mut self, items: Vec<Value>) -> Result<(), PickleError> {
        let (max_depth, at) = (self.limits.max_depth, self.op_at);
        let target = self.top_mut()?;
        let Value::List(l, d) = target else {
            return Err(PickleError::Malformed {
                offset: at,
                msg: format!("APPEND to a {}", target.kind()),
            });
        };
        *d = nested_depth(*d, &items, max_depth, at)?;
        // Copy-on-write when the memo shares the list: charge for the copy.
        let cost = if Rc::strong_count(l) > 1 {
            l.len() as u64
        } else {
            0
        };
        Rc::make_mut(l).extend(items);
        self.charge(cost)
    }

    fn set_items(&mut self, items: Vec<Value>) -> Result<(), PickleError> {
        if !items.len().is_multiple_of(2) {
            return Err(self.malformed("SETITEMS with an odd number of items"));
        }
        let (max_depth, at) = (self.limits.max_depth, self.op_at);
        let target = self.top_mut()?;
        let Value::Dict(m, d) = target else {
            return Err(PickleError::Malformed {
                offset: at,
                msg: format!("SETITEM on a {}", target.kind()),
            });
        };
        *d = nested_depth(*d, &items, max_depth, at)?;
        let cost = if Rc::strong_count(m) > 1 {
            m.len() as u64
        } else {
            0
        };
        let m = Rc::make_mut(m);
        let mut it = items.into_iter();
        while let (Some(k), Some(v)) = (it.next(), it.next()) {
            m.push((k, v));
        }
        self.charge(cost)
    }

    fn reduce(&mut self, f: Value, args: Value) -> Result<Value, PickleError> {
        let Value::Tuple(args, _) = args else {
            return Err(self.malformed(format!(
                "REDUCE arguments are a {}, not a tuple",
                args.kind()
            )));
        };
        match f {
            Value::Global(Global::OrderedDict) => {
                if !args.is_empty() {
                    return Err(self.malformed("OrderedDict called with arguments"));
                }
                Ok(Value::Dict(Rc::new(Vec::new()), 1))
            }
            Value::Global(Global::RebuildTensorV2) => self.rebuild_tensor(&args),
            Value::Global(Global::RebuildParameter) => match args.first() {
                Some(t @ Value::Tensor(_)) if args.len() >= 2 && args.len() <= 3 => Ok(t.clone()),
                _ => {
                    Err(self.malformed("_rebuild_parameter expects (tensor, requires_grad, hooks)"))
                }
            },
            Value::Global(g) => Err(self.malformed(format!("global {g:?} is not callable"))),
            other => Err(self.malformed(format!("REDUCE on a {}", other.kind()))),
        }
    }

    fn int_list(&self, v: &Value, what: &str) -> Result<Vec<u64>, PickleError> {
        let items: &[Value] = match v {
            Value::Tuple(t, _) => t,
            Value::List(l, _) => l,
            _ => {
                return Err(self.malformed(format!("tensor {what} is a {}, not a tuple", v.kind())))
            }
        };
        if items.len() > self.limits.max_dims {
            return Err(self.limit(format!(
                "tensor {what} has {} dims (max {})",
                items.len(),
                self.limits.max_dims
            )));
        }
        items
            .iter()
            .map(|x| match x {
                Value::Int(i) => u64::try_from(*i)
                    .map_err(|_| self.malformed(format!("negative tensor {what} {i}"))),
                o => Err(self.malformed(format!("tensor {what} element is a {}", o.kind()))),
            })
            .collect()
    }

    fn rebuild_tensor(&self, args: &[Value]) -> Result<Value, PickleError> {
        // (storage, storage_offset, size, stride, requires_grad, backward_hooks[, metadata])
        if args.len() < 4 || args.len() > 7 {
            return Err(self.malformed(format!("_rebuild_tensor_v2 with {} arguments", args.len())));
        }
        let Value::Storage(storage) = &args[0] else {
            return Err(self.malformed(format!(
                "_rebuild_tensor_v2 storage is a {}",
                args[0].kind()
            )));
        };
        let storage_offset = match &args[1] {
            Value::Int(i) => u64::try_from(*i)
                .map_err(|_| self.malformed(format!("negative storage offset {i}")))?,
            o => return Err(self.malformed(format!("storage offset is a {}", o.kind()))),
        };
        let size = self.int_list(&args[2], "size")?;
        let stride = self.int_list(&args[3], "stride")?;
        if size.len() != stride.len() {
            return Err(self.malformed(format!(
                "tensor size has {} dims but stride has {}",
                size.len(),
                stride.len()
            )));
        }
        Ok(Value::Tensor(Rc::new(TensorRef {
            storage: storage.clone(),
            storage_offset,
            size,
            stride,
        })))
    }

    fn persistent_load(&self, pid: Value) -> Result<Value, PickleError> {
        let Value::Tuple(t, _) = &pid else {
            return Err(self.malformed(format!("persistent id is a {}, not a tuple", pid.kind())));
        };
        match &t[..] {
            [Value::Str(tag), Value::Global(Global::Storage(st)), key, Value::Str(loc), Value::Int(numel)]
                if &**tag == "storage" =>
            {
                let key = match key {
                    Value::Str(s) => s.to_string(),
                    Value::Int(i) => i.to_string(),
                    o => return Err(self.malformed(format!("storage key is a {}", o.kind()))),
                };
                let numel = u64::try_from(*numel)
                    .map_err(|_| self.malformed(format!("negative storage size {numel}")))?;
                Ok(Value::Storage(Rc::new(StorageRef {
                    storage_type: *st,
                    key,
                    location: loc.to_string(),
                    numel,
                })))
            }
            [Value::Str(tag), Value::Global(g), ..] if &**tag == "storage" => {
                Err(self.malformed(format!("storage type {g:?} is not a storage class")))
            }
            _ => {
                Err(self.malformed("persistent id is not ('storage', type, key, location, numel)"))
            }
        }
    }

    fn run(&mut self) -> Result<Value, PickleError> {
        loop {
            self.op_at = self.pos;
            if self.pos >= self.data.len() {
                return Err(PickleError::NoStop);
            }
            let op = self.u8("opcode")?;
            match op {
                0x80 => {
                    // PROTO
                    let p = self.u8("PROTO")?;
                    if p > 5 {
                        return Err(self.malformed(format!("unsupported pickle protocol {p}")));
                    }
                }
                0x95 => {
                    // FRAME: the length is advisory; just validate it fits.
                    let n = self.u64("FRAME")?;
                    let have = self.data.len() - self.pos;
                    if n > have as u64 {
                        return Err(PickleError::Truncated {
                            offset: self.op_at,
                            what: "FRAME",
                            need: n,
                            have,
                        });
                    }
                }
                b'.' => {
                    // STOP
                    let v = self.pop()?;
                    return Ok(v);
                }
                b'(' => self.push_mark()?,
                b'}' => self.push(Value::Dict(Rc::new(Vec::new()), 1))?,
                b']' => self.push(Value::List(Rc::new(Vec::new()), 1))?,
                b')' => self.push(Value::Tuple(Rc::new([]), 1))?,
                b'N' => self.push(Value::None)?,
                0x88 => self.push(Value::Bool(true))?,
                0x89 => self.push(Value::Bool(false))?,
                b'J' => {
                    let v = self.u32("BININT")? as i32;
                    self.push(Value::Int(v as i64))?
                }
                b'K' => {
                    let v = self.u8("BININT1")?;
                    self.push(Value::Int(v as i64))?
                }
                b'M' => {
                    let v = self.u16("BININT2")?;
                    self.push(Value::Int(v as i64))?
                }
                0x8a => {
                    // LONG1
                    let n = self.u8("LONG1")?;
                    let b = self.take(n as u64, "LONG1")?;
                    if n > 8 {
                        return Err(
                            self.malformed(format!("LONG1 of {n} bytes does not fit in 64 bits"))
                        );
                    }
                    let v = if n == 0 {
                        0
                    } else {
                        let neg = b[b.len() - 1] & 0x80 != 0;
                        let mut a = [if neg { 0xff } else { 0 }; 8];
                        a[..b.len()].copy_from_slice(b);
                        i64::from_le_bytes(a)
                    };
                    self.push(Value::Int(v))?
                }
                b'G' => {
                    let b = self.take(8, "BINFLOAT")?;
                    let mut a = [0u8; 8];
                    a.copy_from_slice(b);
                    self.push(Value::Float(f64::from_be_bytes(a)))?
                }
                b'X' => {
                    let n = self.u32("BINUNICODE length")?;
                    let b = self.take(n as u64, "BINUNICODE")?;
                    self.charge(n as u64 / 64)?;
                    let v = self.str_value(b, "BINUNICODE")?;
                    self.push(v)?
                }
                0x8c => {
                    let n = self.u8("SHORT_BINUNICODE length")?;
                    let b = self.take(n as u64, "SHORT_BINUNICODE")?;
                    let v = self.str_value(b, "SHORT_BINUNICODE")?;
                    self.push(v)?
                }
                0x8d => {
                    let n = self.u64("BINUNICODE8 length")?;
                    let b = self.take(n, "BINUNICODE8")?;
                    self.charge(n / 64)?;
                    let v = self.str_value(b, "BINUNICODE8")?;
                    self.push(v)?
                }
                b'T' | b'B' => {
                    // BINSTRING (py2 str) / BINBYTES
                    let n = self.u32("BINSTRING length")?;
                    let b = self.take(n as u64, "BINSTRING")?;
                    self.charge(n as u64 / 64)?;
                    let v = if op == b'T' {
                        match std::str::from_utf8(b) {
                            Ok(s) => Value::Str(s.into()),
                            Err(_) => Value::Bytes(b.into()),
                        }
                    } else {
                        Value::Bytes(b.into())
                    };
                    self.push(v)?
                }
                b'U' | b'C' => {
                    let n = self.u8("SHORT_BINSTRING length")?;
                    let b = self.take(n as u64, "SHORT_BINSTRING")?;
                    let v = if op == b'U' {
                        match std::str::from_utf8(b) {
                            Ok(s) => Value::Str(s.into()),
                            Err(_) => Value::Bytes(b.into()),
                        }
                    } else {
                        Value::Bytes(b.into())
                    };
                    self.push(v)?
                }
                b't' => {
                    let items = self.pop_to_mark()?;
                    let t = self.make_tuple(items);
                    self.push(t)?
                }
                0x85..=0x87 => {
                    let n = (op - 0x84) as usize;
                    let mut items = Vec::with_capacity(n);
                    for _ in 0..n {
                        items.push(self.pop()?);
                    }
                    items.reverse();
                    let t = self.make_tuple(items);
                    self.push(t)?
                }
                b'l' => {
                    let items = self.pop_to_mark()?;
                    let d = items.iter().map(Value::depth).max().unwrap_or(0) + 1;
                    self.push(Value::List(Rc::new(items), d))?
                }
                b'd' => {
                    let items = self.pop_to_mark()?;
                    self.push(Value::Dict(Rc::new(Vec::new()), 1))?;
                    self.set_items(items)?
                }
                b'a' => {
                    let v = self.pop()?;
                    self.append_items(vec![v])?
                }
                b'e' => {
                    let items = self.pop_to_mark()?;
                    self.append_items(items)?
                }
                b's' => {
                    let v = self.pop()?;
                    let k = self.pop()?;
                    self.set_items(vec![k, v])?
                }
                b'u' => {
                    let items = self.pop_to_mark()?;
                    self.set_items(items)?
                }
                b'q' => {
                    let i = self.u8("BINPUT")?;
                    self.memo_put(i as u32)?
                }
                b'r' => {
                    let i = self.u32("LONG_BINPUT")?;
                    self.memo_put(i)?
                }
                0x94 => {
                    // MEMOIZE
                    let i = u32::try_from(self.memo.len())
                        .map_err(|_| self.limit("memo index overflow"))?;
                    self.memo_put(i)?
                }
                b'h' => {
                    let i = self.u8("BINGET")?;
                    self.memo_get(i as u32)?
                }
                b'j' => {
                    let i = self.u32("LONG_BINGET")?;
                    self.memo_get(i)?
                }
                b'0' => {
                    self.pop()?;
                }
                b'1' => {
                    self.pop_to_mark()?;
                }
                b'2' => {
                    let v = match self.stack.last() {
                        Some(Slot::V(v)) => v.clone(),
                        _ => return Err(self.malformed("DUP with no value on the stack")),
                    };
                    self.push(v)?
                }
                b'c' => {
                    let module = self.line("GLOBAL module")?;
                    let name = self.line("GLOBAL name")?;
                    let g = resolve_global(module, name)?;
                    self.push(Value::Global(g))?
                }
                0x93 => {
                    // STACK_GLOBAL
                    let name = self.pop()?;
                    let module = self.pop()?;
                    let (Value::Str(m), Value::Str(n)) = (&module, &name) else {
                        return Err(self.malformed("STACK_GLOBAL operands are not strings"));
                    };
                    let g = resolve_global(m, n)?;
                    self.push(Value::Global(g))?
                }
                b'R' => {
                    let args = self.pop()?;
                    let f = self.pop()?;
                    let v = self.reduce(f, args)?;
                    self.push(v)?
                }
                b'Q' => {
                    let pid = self.pop()?;
                    let v = self.persistent_load(pid)?;
                    self.push(v)?
                }
                b'b' => {
                    // BUILD: only no-op states are accepted.
                    let state = self.pop()?;
                    let empty = match &state {
                        Value::None => true,
                        Value::Dict(d, _) => d.is_empty(),
                        Value::Tuple(t, _) => t.is_empty(),
                        _ => false,
                    };
                    self.top_mut()?;
                    if !empty {
                        return Err(self
                            .malformed(format!("BUILD with a non-empty {} state", state.kind())));
                    }
                }
                _ => {
                    return Err(PickleError::UnsupportedOpcode {
                        opcode: op,
                        offset: self.op_at,
                    })
                }
            }
        }
    }
}

/// The nesting depth of a container of depth `current` after adding
/// `items`, or an error past `max_depth`.
fn nested_depth(
    current: u32,
    items: &[Value],
    max_depth: u32,
    at: usize,
) -> Result<u32, PickleError> {
    let depth = current.max(items.iter().map(Value::depth).max().unwrap_or(0) + 1);
    if depth > max_depth {
        return Err(PickleError::Limit {
            offset: at,
            msg: format!("objects nested deeper than {max_depth}"),
        });
    }
    Ok(depth)
}

#[cfg(test)]
mod tests;
